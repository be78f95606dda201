"""``hydra/launcher=vmap``: fxtrain's Hydra launcher that trains batchable jobs of a multirun as one vmapped process.

    python -m fxtrain.train -m hydra/launcher=vmap optim.chain.adamw.learning_rate=1e-3,3e-3,1e-2 seed=0,1
    python -m fxtrain.train -m hydra/launcher=vmap_submitit_slurm hydra.launcher.executor.slurm_partition=gpu ...

Hydra finds this class by scanning the ``hydra_plugins`` namespace package; its configs are
``conf/hydra/launcher/vmap*.yaml``. :meth:`VmapLauncher.launch` does what Hydra's ``BasicLauncher`` does
(``load_sweep_config`` per job, ``run_job``, logging set up between jobs), except that the jobs
:func:`fxtrain.sweep.plan` can batch are first trained together by :func:`fxtrain.sweep.train_group`;
each of them then still goes through ``run_job``, whose task function hands back what the group computed
for it, so ``.hydra/``, ``train.log``, the callbacks (``summary.csv``, the sweep table) and the
``JobReturn`` are Hydra's own. Everything else runs job by job with the task function, as with
``hydra/launcher=basic``.

With ``executor`` set, each planned group (a vmapped group, or a job that runs alone) is ONE job of a
submitit executor (``local``: a process on this machine; ``slurm``: a SLURM job), as Hydra's
``hydra_submitit_launcher`` runs each job: the launcher itself is the pickled callable, Hydra's singletons
travel with it, and the submitit job runs the same code as the in-process launcher for its own group.

The work lives in :mod:`fxtrain.sweep`; this module stays light, because Hydra imports every plugin module
whenever any Hydra app starts (submitit is imported only when a launch uses it).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import pathlib
from typing import Any, Callable, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
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
      executor: ``None``: every group in this process, one after the other. Or a submitit executor, each
        group one job of it: ``cluster`` (``local`` or ``slurm``), ``folder`` (submitit's logs and pickles,
        ``%j`` is the job id), and submitit's ``AutoExecutor`` parameters (``timeout_min``,
        ``gpus_per_node``, ``cpus_per_task``, ``mem_gb``, ``slurm_partition``, ``slurm_max_num_timeout``...;
        ``null`` leaves submitit's default).
      compile: run each group's vmapped step and evaluation under ``torch.compile`` (one graph per config and
        shapes, see :func:`fxtrain.sweep.vmapped_steps`); ``False`` (the default) runs them eagerly, which
        measured faster end to end on a 2-core CPU, where compiling costs more than the steps it speeds up
        (experiments/bench/results/sweep.md).
      cache_dir: with ``compile``, where torch.compile keeps compiled code across processes, so a later sweep of
        the same config and shapes loads it instead of compiling (:func:`fxtrain.sweep.compile_cache`); ``None``:
        ``$TORCHINDUCTOR_CACHE_DIR`` when set, else ``~/.cache/fxtrain/compile``.
    """

    def __init__(self, max_group_size: int | None = None, executor: Any = None, compile: bool = False,  # noqa: A002
                 cache_dir: str | None = None) -> None:
        super().__init__()
        self.check_settings(max_group_size, executor, compile, cache_dir)
        self.max_group_size = max_group_size
        self.compile = compile
        self.cache_dir = cache_dir
        self.executor = _executor_spec(executor)
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None
        self.unbatchable: str | None = None  # why no job of this launch can be vmapped (None: they can)

    @staticmethod
    def check_settings(max_group_size: int | None = None, executor: Any = None, compile: bool = False,  # noqa: A002
                       cache_dir: str | None = None) -> None:
        """Raises ``ValueError("hydra.launcher.<key>=<value>: ...")`` for a setting this launcher cannot take (the keys under
        ``hydra.launcher``); :func:`fxtrain.validate.check_launcher` calls it before anything is launched.

        >>> VmapLauncher.check_settings(compile=1)
        Traceback (most recent call last):
        ...
        ValueError: hydra.launcher.compile=1: expected true or false
        """
        if max_group_size is not None and (isinstance(max_group_size, bool) or not isinstance(max_group_size, int)
                                           or max_group_size < 1):
            raise ValueError(f"hydra.launcher.max_group_size={max_group_size!r}: expected a positive whole number or null (no limit)")
        if not isinstance(compile, bool):  # 1 == True: `compile not in (True, False)` took 1 for true
            raise ValueError(f"hydra.launcher.compile={compile!r}: expected true or false")
        if cache_dir is not None and (not isinstance(cache_dir, str) or not cache_dir.strip()):
            raise ValueError(f"hydra.launcher.cache_dir={cache_dir!r}: expected a directory path or null "
                             "($TORCHINDUCTOR_CACHE_DIR, else ~/.cache/fxtrain/compile)")
        _executor_spec(executor)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function
        _ComposedOnce.install(hydra_context.config_loader)
        # Decided here, in the launching process, where the task function is still itself: a submitit job gets
        # this launcher through cloudpickle, which pickles the task function by value and (cloudpickle >= 3.1)
        # renames its source file "<dynamic-code>", so the same check there saw a foreign task function and
        # ran every group job by job, silently.
        self.unbatchable = _not_batchable_launch(config, task_function)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Runs the jobs (``job_overrides[k]`` is job ``initial_job_idx + k``); returns their ``JobReturn``s in order."""
        setup_globals()
        assert self.config is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        pathlib.Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        where = "locally" if self.executor is None else f"as submitit '{self.executor['cluster']}' jobs"
        log.info(f"Launching {len(job_overrides)} jobs {where} (vmap launcher)")
        configs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            configs.append(self._sweep_config(overrides, idx, idx))
        _ComposedOnce.forget(self.hydra_context.config_loader)  # what was validated and not launched is stale
        groups = self._plan(configs, notes=True)
        if self.executor is None:
            return self._run_groups(groups, configs)
        return self._submit(groups, dict(enumerate(map(list, job_overrides), start=initial_job_idx)))

    def __call__(self, jobs: Sequence[tuple[int, Sequence[str]]], singleton_state: dict,
                 planned: tuple[str, list[str]] = ("", [])) -> list[JobReturn]:
        """One submitit job: the jobs of one planned group (``(num, overrides)`` each), trained as the in-process
        launcher trains a group; Hydra's globals set up as ``hydra_submitit_launcher`` sets them up. ``planned``:
        the group's name and reasons as the launching process planned them among all the launch's jobs."""
        import submitit

        Singleton.set_state(singleton_state)
        setup_globals()
        assert self.config is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        job_id = submitit.JobEnvironment().job_id
        configs = [self._sweep_config(overrides, num, job_id) for num, overrides in jobs]
        groups = self._plan(configs, notes=False)
        for group in groups:  # this job's jobs alone cannot say why the launch put them apart
            group.name, group.reasons = planned[0] or group.name, [*planned[1], *group.reasons]
        return self._run_groups(groups, configs)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's hook on timeout or preemption: the same group submitted again (with ``resume=auto``
        each job continues from its newest checkpoint; ``slurm_max_num_timeout`` says how many times)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    def _sweep_config(self, overrides: Sequence[str], num: int, job_id: Any) -> DictConfig:
        assert self.config is not None and self.hydra_context is not None
        sweep_config = _ComposedOnce.take(self.hydra_context.config_loader, self.config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = job_id
            sweep_config.hydra.job.num = num
        return sweep_config

    def _plan(self, configs: list[DictConfig], notes: bool) -> list[Any]:
        """The groups of these jobs (:func:`fxtrain.sweep.plan`); every job alone when the launch cannot batch.
        With ``notes``, the launcher's log gets each group's lines (how it runs, one line per reason it is apart)."""
        from fxtrain import distributed, sweep

        assert self.config is not None and self.task_function is not None

        def alone(c: DictConfig, why: str) -> Any:
            return sweep.Group([sweep.Job(int(c.hydra.job.num), c, pathlib.Path(), [])], {}, "a group of one",
                               reasons=[why])

        if self.unbatchable is not None:
            if notes:
                log.info(f"[vmap] every job runs one by one: {self.unbatchable}")
            return [alone(c, f"apart: {self.unbatchable}") for c in configs]
        jobs = [_job(c) for c in configs]
        groups, planned_notes = sweep.plan([j for j in jobs if j is not None], self.max_group_size,
                                           distributed.rank_and_world()[1])
        for note in planned_notes if notes else []:
            log.info(f"[vmap] {note}")
        for c, j in zip(configs, jobs):  # configs that do not resolve here: their runs say why
            if j is None:
                groups.append(alone(c, "apart: its config does not resolve in the launcher (its run says why)"))
                if notes:
                    log.info(f"[vmap] job {c.hydra.job.num} alone: {groups[-1].reasons[0]}")
        return sorted(groups, key=lambda g: g.jobs[0].num)

    def _run_groups(self, groups: list[Any], configs: list[DictConfig]) -> list[JobReturn]:
        """Trains each group vmapped (or its jobs one by one), then every job through ``run_job``; in job order."""
        from fxtrain import sweep

        assert self.task_function is not None
        by_num = {int(c.hydra.job.num): c for c in configs}
        returns: dict[int, JobReturn] = {}
        if self.compile and any(group.sequential is None for group in groups):
            log.info(f"[vmap] compiled code cached in {sweep.compile_cache(self.cache_dir)}")
        for group in groups:
            if group.sequential is None:
                try:
                    results = sweep.train_group(group, compile=self.compile)
                except Exception as e:  # noqa: BLE001 - nothing written yet: the jobs run as the basic launcher runs them
                    why = str(e) if isinstance(e, sweep.NotBatchable) else f"{type(e).__name__}: {e}"
                    group.sequential = why.splitlines()[0] if why else type(e).__name__  # a one-line note
                else:
                    for job, result in zip(group.jobs, results):
                        returns[job.num] = self._run(by_num[job.num], _recorded(result, sweep.job_notes(group, job)))
                    continue
            if len(group.jobs) > 1:
                log.info(f"[vmap] {group.label()} run one by one: {group.sequential}")
            for job in group.jobs:
                returns[job.num] = self._run(by_num[job.num], _noted(self.task_function, sweep.job_notes(group, job)))
        return [returns[num] for num in sorted(returns)]

    def _submit(self, groups: list[Any], overrides: dict[int, list[str]]) -> list[JobReturn]:
        """One submitit job per group (``executor.map_array``, each runs :meth:`__call__`); waits for all and
        returns every job's ``JobReturn``, in job order."""
        assert self.executor is not None
        executor = _executor(self.executor)
        work = [[(job.num, overrides[job.num]) for job in group.jobs] for group in groups]
        submitted = executor.map_array(self, work, [Singleton.get_state()] * len(work),
                                       [(group.name, group.reasons) for group in groups])
        for group, job in zip(groups, submitted):
            log.info(f"[vmap] {group.label()}: submitit job {job.job_id}")
        returns = {num: ret for nums, job in zip(work, submitted) for (num, _), ret in zip(nums, job.result())}
        return [returns[num] for num in sorted(returns)]

    def _run(self, sweep_config: DictConfig, task_function: Callable) -> JobReturn:
        """One job through Hydra's ``run_job`` (as ``BasicLauncher`` runs it), then Hydra's logging back."""
        assert self.config is not None and self.hydra_context is not None
        ret = run_job(hydra_context=self.hydra_context, task_function=task_function, config=sweep_config,
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return ret


def _executor_spec(executor: Any) -> dict[str, Any] | None:
    """``hydra.launcher.executor`` as a plain dict (``None`` stays ``None``), checked before anything runs."""
    if executor is None:
        return None
    if not (OmegaConf.is_dict(executor) or isinstance(executor, dict)):
        raise ValueError(f"hydra.launcher.executor={executor!r}: expected null (every group in this process) or submitit's "
                         "settings (hydra/launcher=vmap_submitit_local or vmap_submitit_slurm)")
    spec = OmegaConf.to_container(executor, resolve=True) if OmegaConf.is_config(executor) else dict(executor)
    if spec.get("cluster") not in ("local", "slurm", "debug"):
        raise ValueError(f"hydra.launcher.executor.cluster={spec.get('cluster')!r}: expected local, slurm or debug (submitit's "
                         "executors)")
    if not (isinstance(spec.get("folder"), str) and spec["folder"]):
        raise ValueError(f"hydra.launcher.executor.folder={spec.get('folder')!r}: expected where submitit keeps its logs, e.g. "
                         "${hydra.sweep.dir}/.submitit/%j")
    for key in ("tasks_per_node", "nodes"):
        if spec.get(key) is not None and (type(spec[key]) is not int or spec[key] != 1):
            raise ValueError(f"hydra.launcher.executor.{key}={spec[key]!r}: a vmapped group trains in one process; leave "
                             "nodes and tasks_per_node at 1")
    return spec


def _executor(spec: dict[str, Any]) -> Any:
    """``submitit.AutoExecutor(folder, cluster, **<executor arguments>).update_parameters(**<the rest>)``.

    ``slurm_max_num_timeout`` and the like are arguments of the cluster's executor class, not job
    parameters: they go to the constructor, as submitit expects.
    """
    import submitit
    from submitit.core import plugins

    classes = plugins.get_executors()
    params = {k: v for k, v in spec.items() if k not in ("cluster", "folder")}

    def init_argument(key: str) -> bool:
        ex, _, arg = key.partition("_")
        return ex in classes and arg in inspect.signature(classes[ex]).parameters

    try:
        executor = submitit.AutoExecutor(spec["folder"], spec["cluster"],
                                         **{k: v for k, v in params.items() if init_argument(k)})
        executor.update_parameters(**{k: v for k, v in params.items() if not init_argument(k)})
    except (NameError, AssertionError, ValueError) as e:  # submitit's messages list the valid names
        raise ValueError(f"hydra.launcher.executor ({spec['cluster']}): {e}") from e
    return executor


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


class _ComposedOnce:
    """Hydra's ``load_sweep_config`` with each job's config composed once per launch instead of twice.

    A sweeper composes every job of a batch to validate it (``Sweeper.validate_batch_is_legal``: "this repeats
    work the launcher will do") and drops the result; then the launcher composes each job again. On the default
    experiment a compose takes about 0.2 s, as long as 40 steps of an 8-job group. Installed on the launch's
    config loader, the loader keeps what it composes until the next launch has taken its jobs (:meth:`forget`;
    at most :attr:`KEEP` configs, the oldest dropped first, should a sweeper compose without launching) and
    :meth:`take` hands the launcher that config, once, or composes it where nothing was kept (a sweeper that does
    not validate, a submitit job). The config is Hydra's own result for the same master config and overrides.
    """

    KEEP = 1024

    def __init__(self, load: Callable[..., DictConfig]):
        self.load, self.kept = load, {}

    def __call__(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        cfg = self.load(master_config, sweep_overrides)
        if len(self.kept) >= self.KEEP:
            self.kept.pop(next(iter(self.kept)))
        self.kept[(id(master_config), tuple(sweep_overrides))] = cfg
        return cfg

    @classmethod
    def install(cls, loader: Any) -> None:
        if not isinstance(getattr(loader, "load_sweep_config", None), cls):
            loader.load_sweep_config = cls(loader.load_sweep_config)

    @staticmethod
    def forget(loader: Any) -> None:
        if isinstance(loader.load_sweep_config, _ComposedOnce):
            loader.load_sweep_config.kept.clear()

    @staticmethod
    def take(loader: Any, master_config: DictConfig, overrides: list[str]) -> DictConfig:
        load = loader.load_sweep_config
        if not isinstance(load, _ComposedOnce):
            return load(master_config, overrides)
        cfg = load.kept.pop((id(master_config), tuple(overrides)), None)
        return load.load(master_config, overrides) if cfg is None else cfg


def _job(sweep_config: DictConfig) -> Any:
    """The :class:`fxtrain.sweep.Job` of one sweep config: its run directory as ``run_job`` names it, and its
    task config resolved with Hydra's config set to this job's (``${hydra:...}``); ``None`` if it does not resolve.

    A job given in epochs (``trainer.max_epochs``) is resolved with the ``max_steps`` its run will settle
    (:func:`fxtrain.train.settle_max_steps`), so the schedule and cadences that follow it hold the job's values;
    ``max_steps`` itself stays null in the task config, which the job's run settles again."""
    from fxtrain import build, sweep, train

    saved = HydraConfig.instance().cfg
    try:
        out = os.path.abspath(os.path.join(str(OmegaConf.select(sweep_config, "hydra.sweep.dir")),
                                           str(OmegaConf.select(sweep_config, "hydra.sweep.subdir"))))
        with read_write(sweep_config.hydra.runtime), open_dict(sweep_config.hydra.runtime):
            sweep_config.hydra.runtime.output_dir = out  # as run_job sets it again
        HydraConfig.instance().set_config(sweep_config)
        build.settle_optimized_metric(sweep_config)  # the task's own, as the job's own run would settle it
        settled = copy.deepcopy(sweep_config)  # the config run_job hands the job stays as it is
        if settled.trainer.get("max_epochs") is not None:
            train.settle_max_steps(settled)
        task = {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v
                for k, v in settled.items() if k != "hydra"}
        if sweep_config.trainer.get("max_epochs") is not None:
            task["trainer"]["max_steps"] = sweep_config.trainer.max_steps  # null: settled by the job's run
        overrides = [str(o) for o in OmegaConf.to_container(sweep_config.hydra.overrides.task)]
        return sweep.Job(int(sweep_config.hydra.job.num), OmegaConf.create(task), pathlib.Path(out), overrides)
    except Exception:  # noqa: BLE001 - an interpolation that fails here fails in the job's own run, which says so
        return None
    finally:
        HydraConfig.instance().cfg = saved


def _recorded(result: Any, notes: list[str]) -> Callable[[DictConfig], float]:
    """A task function that hands back what the vmapped group computed for this job (inside ``run_job``, so the
    job's lines, its group's ``notes`` first, reach its ``train.log`` and Hydra records its return value or error)."""

    def task(cfg: DictConfig) -> float:
        del cfg  # trained already
        for line in [*notes, *result.lines]:
            logging.getLogger("fxtrain").info(line)
        if result.error is not None:
            raise result.error
        return result.value

    return task


def _noted(task_function: Callable, notes: list[str]) -> Callable[[DictConfig], Any]:
    """``task_function`` with its job's group ``notes`` (:func:`fxtrain.sweep.job_notes`) logged first, inside
    ``run_job``: the job's ``train.log`` says why it ran alone or one by one."""

    def task(cfg: DictConfig) -> Any:
        for line in notes:
            logging.getLogger("fxtrain").info(line)
        return task_function(cfg)

    return task
