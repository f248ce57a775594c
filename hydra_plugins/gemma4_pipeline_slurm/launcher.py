"""``hydra/launcher=pipeline_slurm``: submitit's Slurm launcher, with each variant's job sized by the preflight.

Hydra's submitit launcher submits a sweep as one job array, every job asking for the same memory and CPUs. A variant's
needs differ (a 2048 bf16 build needs more than a 256 one), and asking each for the largest wastes the cluster, so
this launcher submits one job per variant, each asking for what ``pipeline.cli.slurm.variant_request`` says that
variant needs. Every job's configuration is composed and checked, and the partition read, before anything is
submitted (pipeline/cli/slurm.py says what is refused). Everything else (the queue settings, the job folders, how the
job runs the Hydra task) is submitit's launcher's; the settings are its ``SlurmQueueConf``.

No ``from __future__ import annotations`` here: Hydra's plugin scan runs this module without registering it in
``sys.modules``, where dataclasses would look the postponed annotations up.
"""


from collections.abc import Sequence
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict


@dataclass
class PipelineSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.gemma4_pipeline_slurm.launcher.PipelineSlurmLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="pipeline_slurm", node=PipelineSlurmConf,
                             provider="gemma4-neuron-pipeline")

INIT_KEYS = {"submitit_folder", "max_num_timeout"}  # AutoExecutor's constructor takes these, not update_parameters
SIZED_KEYS = {"mem_gb", "cpus_per_task"}  # set per job, from the preflight


class PipelineSlurmLauncher(SlurmLauncher):
    def requests(self, job_overrides: Sequence[Sequence[str]]) -> list:
        """Each job's configuration, composed and checked as ``python -m pipeline`` would, and its request."""
        from pipeline.cli.slurm import variant_request
        from pipeline.run import load_config

        requests = []
        for overrides in job_overrides:
            sweep = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            variant = sweep.hydra.runtime.choices.get("variant")
            with open_dict(sweep):
                del sweep["hydra"]
            requests.append(variant_request(load_config(sweep, variant), self.params.get("cpus_per_task")))
        return requests

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        from pipeline.cli.slurm import check_fits, check_submittable, partition_nodes
        from pipeline.core.log import log

        requests = self.requests(job_overrides)
        partition = self.params.get("partition")
        check_fits(requests, partition_nodes(partition), partition)
        check_submittable(requests, partition, self.params.get("account"), self.params.get("qos"))
        executor = submitit.AutoExecutor(cluster="slurm", folder=self.params["submitit_folder"],
                                         slurm_max_num_timeout=self.params["max_num_timeout"])
        shared = set(OmegaConf.structured(BaseQueueConf).keys())  # AutoExecutor's own names; the rest are slurm_*
        executor.update_parameters(**{key if key in shared else f"slurm_{key}": value
                                      for key, value in self.params.items()
                                      if key not in INIT_KEYS | SIZED_KEYS and value is not None})
        jobs = []
        for idx, (overrides, request) in enumerate(zip(job_overrides, requests), initial_job_idx):
            executor.update_parameters(mem_gb=request.mem_gb, cpus_per_task=request.cpus,
                                       name=f"pipeline-{request.variant}")
            job = executor.submit(self, list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}",
                                  Singleton.get_state())
            log.info("slurm: job %s for %s", job.job_id, request.describe())
            jobs.append(job)
        return [job.results()[0] for job in jobs]
