"""Parallel degrees, checked before any collective.

A run states degrees, not modes: `pp x dp_replicate x dp_shard x cp x tp == world_size`, and for
MoE an expert-parallel degree `ep` borrowed from `dp_shard x cp` (and from `tp` too when experts are
not tensor-parallel, `etp == 1`), as in dp2ep expert parallel. Pipeline parallel (`pp`) is the
outermost axis: every other degree describes the ranks of one pipeline stage.
"""

from dataclasses import dataclass, fields


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work; the message names the setting and the fix."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1
    world_size: int = 1
    # Last, so positional construction of the other fields keeps working.
    pp: int = 1

    def __post_init__(self):
        # Resolve dp_shard = -1 here so every later reader sees plain degrees.
        object.__setattr__(self, "dp_shard", self._resolve_dp_shard())
        self._validate()

    def _resolve_dp_shard(self) -> int:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ParallelConfigError(f"parallelism.{f.name} must be an integer, got {value!r}.")
            if f.name != "dp_shard" and value < 1:
                raise ParallelConfigError(f"parallelism.{f.name} = {value}: degrees must be >= 1.")
        if self.dp_shard == -1:
            others = self.pp * self.dp_replicate * self.cp * self.tp
            if self.world_size % others:
                names, values = self._degree_names(("dp_replicate", "cp", "tp"))
                raise ParallelConfigError(
                    f"cannot infer parallelism.dp_shard: world size {self.world_size} is not divisible by "
                    f"{names} = {values} = {others}. "
                    "Change those degrees or the number of ranks."
                )
            return self.world_size // others
        if self.dp_shard < 1:
            raise ParallelConfigError(
                f"parallelism.dp_shard = {self.dp_shard}: use a degree >= 1, or -1 to infer it from the world size."
            )
        return self.dp_shard

    def _degree_names(self, names: tuple[str, ...]) -> tuple[str, str]:
        """("pp * a * b", "2 * x * y"), pp named only when set, so pp = 1 messages read as before."""
        names = (("pp",) if self.pp > 1 else ()) + names
        return " * ".join(names), " * ".join(str(getattr(self, n)) for n in names)

    def _validate(self) -> None:
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            names, values = self._degree_names(("dp_replicate", "dp_shard", "cp", "tp"))
            raise ParallelConfigError(
                f"{names} = {values} = {product}, but the world size is {self.world_size}. Make the product equal "
                "the number of ranks, or set parallelism.dp_shard = -1 to infer it."
            )
        if self.etp not in (1, self.tp):
            raise ParallelConfigError(
                f"parallelism.etp = {self.etp}: expert tensor parallel must be 1 or equal to tp ({self.tp})."
            )
        if self.ep > 1:
            # EP groups are made of whole cp groups (and whole tp groups when etp == 1), borrowed from
            # the ranks that shard data, so that every expert-FSDP group is the same size.
            borrowed = self.cp * (self.tp if self.etp == 1 else 1)
            pool = self.dp_shard * borrowed
            borrowed_desc = "cp * tp" if self.etp == 1 and self.tp > 1 else "cp"
            if self.ep % borrowed:
                raise ParallelConfigError(
                    f"parallelism.ep = {self.ep} must be a multiple of {borrowed_desc} = {borrowed}: expert "
                    "parallel is borrowed from dp_shard x cp" + (" x tp (etp = 1)" if borrowed_desc != "cp" else "")
                    + ". Raise ep or lower cp/tp."
                )
            if pool % self.ep:
                raise ParallelConfigError(
                    f"parallelism.ep = {self.ep} must divide dp_shard * {borrowed_desc} = {pool}: expert parallel "
                    "is borrowed from those ranks. Pick an ep that divides it, or raise dp_shard."
                )

    # Derived degrees -------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Ranks that see different data (data loading)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """Ranks FSDP shards non-expert parameters over."""
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        """Ranks the loss is averaged over."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks FSDP shards expert parameters over: what is left of dp_shard x cp x tp after ep x etp."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    @property
    def stage_world_size(self) -> int:
        """Ranks of one pipeline stage: the world every other degree tiles."""
        return self.world_size // self.pp

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard_cp > 1

    @property
    def replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def loss_parallel_possible(self) -> bool:
        return self.tp > 1
