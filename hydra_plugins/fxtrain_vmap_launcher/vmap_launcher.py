"""``hydra/launcher=vmap``: fxtrain's Hydra launcher that trains batchable jobs of a multirun as one vmapped process.

    python -m fxtrain.train -m hydra/launcher=vmap optim.chain.adamw.learning_rate=1e-3,3e-3,1e-2 seed=0,1

Hydra finds this class by scanning the ``hydra_plugins`` namespace package; its config is
``conf/hydra/launcher/vmap.yaml``. :meth:`VmapLauncher.launch` does what Hydra's ``BasicLauncher`` does
(``load_sweep_config`` per job, ``run_job``, logging set up between jobs), except that the jobs
:func:`fxtrain.sweep.plan` can batch are first trained together by :func:`fxtrain.sweep.train_group`;
each of them then still goes through ``run_job``, whose task function hands back what the group computed
for it, so ``.hydra/``, ``train.log``, the callbacks (``summary.csv``, the sweep table) and the
``JobReturn`` are Hydra's own. Everything else runs job by job with the task function, as with
``hydra/launcher=basic``. The work lives in :mod:`fxtrain.sweep`; this module stays light, because Hydra
imports every plugin module whenever any Hydra app starts.
"""

from __future__ import annotations

import inspect
import logging
import os
import pathlib
from typing import Any, Callable, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)


class VmapLauncher(Launcher):
    """Runs a multirun's jobs, training the groups that differ only in batchable values as one vmapped process.

    Args:
      max_group_size: at most this many jobs in one vmapped process (params and optimizer state of every
        job of a group are in memory at once); ``None``: no limit.
    """

    def __init__(self, max_group_size: int | None = None) -> None:
        super().__init__()
        if max_group_size is not None and (not isinstance(max_group_size, int) or max_group_size < 1):
            raise ValueError(f"hydra.launcher.max_group_size: expected a positive integer or null, got {max_group_size!r}")
        self.max_group_size = max_group_size
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Runs the jobs (``job_overrides[k]`` is job ``initial_job_idx + k``); returns their ``JobReturn``s in order."""
        from fxtrain import distributed, sweep

        setup_globals()
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        pathlib.Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs locally (vmap launcher)")
        configs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            configs.append(sweep_config)

        why = _not_batchable_launch(self.config, self.task_function)
        if why is not None:
            log.info(f"[vmap] every job runs one by one: {why}")
            return [self._run(c, self.task_function) for c in configs]
        jobs = [_job(c) for c in configs]
        groups, notes = sweep.plan([j for j in jobs if j is not None], self.max_group_size,
                                   distributed.rank_and_world()[1])
        groups += [sweep.Group([sweep.Job(c.hydra.job.num, c, pathlib.Path(), [])], {}, "a group of one")
                   for c, j in zip(configs, jobs) if j is None]  # configs that do not resolve: their runs say why
        for note in notes:
            log.info(f"[vmap] {note}")
        by_num = {int(c.hydra.job.num): c for c in configs}
        returns: dict[int, JobReturn] = {}
        for group in groups:
            if group.sequential is None:
                try:
                    results = sweep.train_group(group)
                except Exception as e:  # noqa: BLE001 - nothing written yet: the jobs run as the basic launcher runs them
                    why = str(e) if isinstance(e, sweep.NotBatchable) else f"{type(e).__name__}: {e}"
                    group.sequential = why.splitlines()[0] if why else type(e).__name__  # a one-line note
                else:
                    for job, result in zip(group.jobs, results):
                        returns[job.num] = self._run(by_num[job.num], _recorded(result))
                    continue
            if len(group.jobs) > 1:
                log.info(f"[vmap] {group.label()} run one by one: {group.sequential}")
            for job in group.jobs:
                returns[job.num] = self._run(by_num[job.num], self.task_function)
        return [returns[num] for num in sorted(returns)]

    def _run(self, sweep_config: DictConfig, task_function: Callable) -> JobReturn:
        """One job through Hydra's ``run_job`` (as ``BasicLauncher`` runs it), then Hydra's logging back."""
        assert self.config is not None and self.hydra_context is not None
        ret = run_job(hydra_context=self.hydra_context, task_function=task_function, config=sweep_config,
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return ret


def _not_batchable_launch(config: DictConfig, task_function: Callable) -> str | None:
    """Why no job of this launch can join a vmapped group (``None``: they can), from Hydra's settings.

    The groups train outside ``run_job``: in the launch directory, without ``hydra.job.env_set``; jobs
    that would see another working directory or environment in their own runs run one by one.
    """
    from fxtrain import train

    try:
        ours = pathlib.Path(inspect.getfile(task_function)).resolve() == pathlib.Path(train.__file__).resolve()
    except TypeError:  # a callable without a source file
        ours = False
    if not ours:  # python -m fxtrain.train's task function has __module__ == "__main__": compare files
        return "the task function is not fxtrain.train's"
    if config.hydra.job.chdir:
        return "hydra.job.chdir=true (each job runs in its own directory)"
    if config.hydra.job.env_set:
        return f"hydra.job.env_set sets {', '.join(config.hydra.job.env_set)} per job"
    return None


def _job(sweep_config: DictConfig) -> Any:
    """The :class:`fxtrain.sweep.Job` of one sweep config: its run directory as ``run_job`` names it, and its
    task config resolved with Hydra's config set to this job's (``${hydra:...}``); ``None`` if it does not resolve."""
    from fxtrain import sweep

    saved = HydraConfig.instance().cfg
    try:
        out = os.path.abspath(os.path.join(str(OmegaConf.select(sweep_config, "hydra.sweep.dir")),
                                           str(OmegaConf.select(sweep_config, "hydra.sweep.subdir"))))
        with read_write(sweep_config.hydra.runtime), open_dict(sweep_config.hydra.runtime):
            sweep_config.hydra.runtime.output_dir = out  # as run_job sets it again
        HydraConfig.instance().set_config(sweep_config)
        task = {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v
                for k, v in sweep_config.items() if k != "hydra"}
        overrides = [str(o) for o in OmegaConf.to_container(sweep_config.hydra.overrides.task)]
        return sweep.Job(int(sweep_config.hydra.job.num), OmegaConf.create(task), pathlib.Path(out), overrides)
    except Exception:  # noqa: BLE001 - an interpolation that fails here fails in the job's own run, which says so
        return None
    finally:
        HydraConfig.instance().cfg = saved


def _recorded(result: Any) -> Callable[[DictConfig], float]:
    """A task function that hands back what the vmapped group computed for this job (inside ``run_job``, so the
    job's lines reach its ``train.log`` and Hydra records its return value or error)."""

    def task(cfg: DictConfig) -> float:
        del cfg  # trained already
        for line in result.lines:
            logging.getLogger("fxtrain").info(line)
        if result.error is not None:
            raise result.error
        return result.value

    return task
