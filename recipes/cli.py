"""The training command: ``python train.py [group=option ...] [key=value ...]``, or ``kpool-train``
once the package is installed (``pip install .``; the ``conf/`` tree ships inside the package as
``recipes/conf``).

Runs on every rank under torchrun or srun; each rank composes the same config and trains into the
same run directory (see conf/config.yaml). ``--cfg job`` prints the composed config. Before Hydra
composes, every override key is checked against the schema and the run directory is chosen (a rerun
resumes the command's last unfinished run, :mod:`recipes.launch.run_dir`).
"""

from recipes.launch import console

console.quiet()  # before megatron-core is imported (below, through recipes.config.schema)

import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra._internal.utils import get_args_parser  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from recipes.launch.cli_info import answer_info_flags, register_help_resolver  # noqa: E402
from recipes.config.keys import check_overrides  # noqa: E402
from recipes.config.schema import register_configs  # noqa: E402
from recipes.launch.distributed import register_resolvers  # noqa: E402
from recipes.launch.run_dir import run_root, select_run  # noqa: E402
from recipes.launch.run_owner import check_free  # noqa: E402
from recipes.observe.sweep import SweepSummaryCallback  # noqa: E402
from recipes.launch.unstarted_runs import discard_if_unstarted  # noqa: E402

register_resolvers()
register_help_resolver()
register_configs()
# megatron-core logs its full DDP/optimizer configs and bucket layouts at INFO.
logging.getLogger("megatron").setLevel(logging.WARNING)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _task(cfg: DictConfig) -> float:
    from recipes.loop import run

    hc = HydraConfig.get()
    single, run_dir = hc.mode == RunMode.RUN, Path(hc.runtime.output_dir)
    with console.config_errors(exit_on_error=single), \
            discard_if_unstarted(run_dir, single_run=single, dry_run=bool(cfg.train.dry_run)):
        sweep = Path(hc.sweep.dir).name if hc.mode == RunMode.MULTIRUN else None
        return run(cfg, run_dir, list(hc.overrides.task), wandb_group=sweep)
    return math.nan  # a sweep job's config error, printed above


def main() -> None:
    """Check the overrides, pick the run directory (announced on the first line), train."""
    if answer_info_flags(sys.argv[1:]):
        return
    args = get_args_parser().parse_known_args(sys.argv[1:])[0]
    with console.config_errors(exit_on_error=True):
        check_overrides(args.overrides)
    if not (args.multirun or args.cfg or args.help or args.hydra_help or args.info):
        with console.config_errors(exit_on_error=True):
            first_line = select_run(args.overrides)
            if console.env_rank() == 0:  # before Hydra writes into a live run's directory
                check_free(run_root() / os.environ["KPOOL_RUN_ID"])
        if console.env_rank() == 0:
            print(first_line, flush=True)
    _task()
    if args.multirun and SweepSummaryCallback.failed_jobs:
        sys.exit(1)
