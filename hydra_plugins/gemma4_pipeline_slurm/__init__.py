"""The pipeline's Slurm launcher for Hydra (``hydra/launcher=pipeline_slurm``): see launcher.py."""
