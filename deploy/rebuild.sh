#!/bin/sh
# Scheduled rebuild of every variant when the Neuron compiler stack has a new release.
#
# Run from a checkout on an inf2 host (the GitHub Actions workflow and the systemd service both call this):
#   1. check-remote  refuse, before any build work, a DVC remote this host cannot read and write (a bucket that does
#                    not exist, credentials it refuses: pipeline/cli/remote.py);
#      dvc pull      restore the last build's outputs from the DVC remote, so unchanged stages are not rebuilt;
#   2. check-upgrades (Neuron packages from the Neuron repository only): exit 0 up to date, 3 an upgrade is available,
#      4 the repository has a release newer than pipeline/backends/neuron_sdk.py's table (stop: add its row),
#      anything else an error (stop here);
#   3. on 3 (and UPGRADE=apply, the default) `check-upgrades --apply` installs the new release whole and runs
#      `dvc repro`; on 0, `dvc repro` alone (only the toolchain stage runs unless conf/, code or variants changed);
#      either way every rebuilt variant is traced, packaged, validated, regression-gated and published;
#   4. refresh-index write the published signed index (versions.json) again when half its lifetime is gone, so that
#                    consumers with the public key keep taking it while nothing new is published;
#   5. dvc push      store the new outputs in the DVC remote for the next run and for other hosts.
#
# Settings (environment):
#   UPGRADE=apply|check   apply (default) installs upgrades; check only reports them and builds nothing new
#   CHECK_ARGS="..."      extra arguments for check-upgrades (e.g. --neuron-index URL, a mirror of the Neuron repository)
#   REPRO_ARGS="..."      extra arguments for dvc repro when no upgrade is applied (e.g. --dry); --force re-runs
#                         the commands, and each stage still skips what is up to date (force=true rebuilds)
#   SKIP_DVC_REMOTE=1     no check-remote / dvc pull / dvc push (no remote configured)
# The remote's credentials come from the usual AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE)
# or the instance role; nothing here prints them.
# Exit status: 0 when the build (if any) and the push succeeded, otherwise the failing step's status.
set -eu

cd "${REPO_DIR:-$(dirname "$0")/..}"
if [ -f .venv/bin/activate ]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi

log() { echo "rebuild: $*" >&2; }

UPGRADE=${UPGRADE:-apply}
case "$UPGRADE" in
    apply|check) ;;
    *) log "UPGRADE=$UPGRADE is not a choice: use UPGRADE=apply or UPGRADE=check"; exit 2 ;;
esac

if [ "${SKIP_DVC_REMOTE:-0}" != 1 ]; then
    python -m pipeline check-remote
    # A first run has nothing on the remote yet: --allow-missing leaves what the remote lacks to dvc repro. Any other
    # failure of the pull stops here, before hours of building that could not be pushed.
    dvc pull --allow-missing
fi

status=0
# shellcheck disable=SC2086
python -m pipeline check-upgrades ${CHECK_ARGS:-} || status=$?
case "$status" in
    0)
        log "the Neuron compiler stack is up to date; dvc repro rebuilds only what changed"
        # shellcheck disable=SC2086
        dvc repro ${REPRO_ARGS:-}
        ;;
    3)
        if [ "$UPGRADE" = check ]; then
            log "an upgrade is available (UPGRADE=check: not applied)"
            exit 3
        fi
        log "upgrading and rebuilding every variant"
        # shellcheck disable=SC2086
        python -m pipeline check-upgrades --apply ${CHECK_ARGS:-}
        ;;
    4)
        log "the Neuron repository has a release newer than pipeline/backends/neuron_sdk.py knows: add its row" \
            "(from Neuron's n2-manifest.json); nothing was built"
        exit 4
        ;;
    *)
        log "check-upgrades failed with status $status; nothing was built"
        exit "$status"
        ;;
esac

# The signed index (versions.json) expires unless written again: while nothing new is published, this keeps it fresh
# (when less than half its lifetime is left; a no-op otherwise).
python -m pipeline refresh-index

if [ "${SKIP_DVC_REMOTE:-0}" != 1 ]; then
    dvc push
fi
log "done"
