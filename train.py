"""Hydra entry point: ``python train.py [group=option ...] [key=value ...]``.

Runs on every rank under torchrun or srun; each rank composes the same config and trains into the
same run directory (see conf/config.yaml). ``python train.py --cfg job`` prints the composed config.
"""

import logging
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from recipes.distributed import register_resolvers
from recipes.schema import register_configs

# megatron-core announces every optional dependency it does not find (TE, apex, absl) on import.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
register_resolvers()
register_configs()
# megatron-core logs its full DDP/optimizer configs and bucket layouts at INFO.
logging.getLogger("megatron").setLevel(logging.WARNING)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from recipes.loop import run

    hc = HydraConfig.get()
    return run(cfg, Path(hc.runtime.output_dir), list(hc.overrides.task))


if __name__ == "__main__":
    main()
