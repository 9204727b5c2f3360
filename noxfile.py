"""plait's sessions: one per package (installs that package alone), combos, lint, train, bench.

    nox -t test        every test session, then one summary line over all of them
    nox -s train       the default training run (Llama 3 debug model on the shipped corpus)
    nox -s mesh        one package's tests in a venv holding only it and what it declares
    nox -s bench       the benchmark suite against torchtitan 0.3.0 (appends to benchmarks/RESULTS.md)
    nox -s parity_table  the last combos run's parity matrix into the README
    nox -s reliability the fault matrix against plait-train (kills, corruption, NaN, locks), one table
    nox -s gpu         every CUDA-only branch against its reference (gpu/run.py); one line and exit 0 without CUDA

Venvs are reused between runs; torch is installed once for all of them (from the pinned wheel,
into .nox/_torch, which each venv's path includes), and so is triton (.nox/_triton) for the venvs
that install plait-models' test extra.
"""

import os
import pathlib
import sys
import xml.etree.ElementTree as ET

import nox

nox.options.reuse_venv = "yes"
# uv where nox has it (`pip install "nox[uv]"`): a package session's install took ~1 min with pip
# (resolving, downloading and unpacking transformers, datasets, pandas, ... into each venv), a few
# seconds with uv's cache. Plain virtualenv + pip where it has not.
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_missing_interpreters = False

ROOT = pathlib.Path(__file__).parent
REPORTS = ROOT / ".nox" / "reports"
PARITY_REPORT = REPORTS / "parity_matrix.json"
TORCH = "torch==2.13.0"  # always pinned: an unpinned torch pulls GBs of CUDA packages
SHARED_TORCH = ROOT / ".nox" / "_torch"  # TORCH and its dependencies, shared by the sessions' venvs
# plait-models' test extra asks for triton (its kernels run interpreted on the CPU): the version
# pinned here is installed once, shared like torch, by the sessions that install that extra.
TRITON = "triton==3.9.0"
SHARED_TRITON = ROOT / ".nox" / "_triton"
# Each package and the sibling packages it declares (installed from this checkout, not PyPI).
PACKAGES = {
    "mesh": [],
    "models": [],
    "data": [],
    "checkpoint": ["mesh", "models"],
    "dataparallel": ["mesh"],
    "tensorparallel": ["mesh"],
    "contextparallel": ["mesh"],
    "expertparallel": ["mesh"],
    "pipelineparallel": ["mesh"],
    "faulttolerance": ["mesh"],
    # faulttolerance: the trainer's optional extra, in its test extra (installed from here, not PyPI)
    "trainer": ["mesh", "models", "dataparallel", "data", "checkpoint", "faulttolerance"],
    "testing": ["mesh"],
    "plan": ["mesh", "models", "dataparallel", "data", "checkpoint", "faulttolerance", "trainer"],
}
ALL = list(PACKAGES)
# Sibling packages a package's tests use but the package never imports: installed after its
# import has been checked alone (the pipeline parity tests run the plait Llama 3 model).
# plait-testing (run_on_ranks, the step sentinel) serves every package's tests: installed with
# plait-mesh, its one dependency, where the package does not already have it.
TEST_ONLY = {name: ["testing"] if "mesh" in deps or name == "mesh" else ["mesh", "testing"]
             for name, deps in PACKAGES.items() if name != "testing"}
TEST_ONLY["pipelineparallel"] += ["models", "dataparallel"]
TEST_ONLY["expertparallel"].append("dataparallel")  # FSDP x EP on transformers MoE models
TEST_ONLY["testing"] = []  # its plait-train helpers are exercised by the trainer's tests


def _install(session: nox.Session, names: list[str], extras: str = "test") -> None:
    _install_shared(session, TORCH, SHARED_TORCH)
    if extras == "test" and "models" in names:
        _install_shared(session, TRITON, SHARED_TRITON)
    # Non-editable installs: the tests see the packages as a user would after `pip install`.
    _install_packages(session, *[f"./packages/{n}[{extras}]" if extras else f"./packages/{n}" for n in names])


def _install_packages(session: nox.Session, *requirements: str) -> None:
    """One resolver call. With uv, torch and triton are left out of the resolution: uv does not see
    the shared installs on the venv's path (a .pth file) and would fetch a CUDA build of torch, GBs.
    With pip, --no-compile: pip byte-compiled every installed module (transformers, pandas, pyarrow,
    ...) in every venv, ~40 s of CPU per heavy session; Python compiles what a test imports, once
    (_pytest lets it write the bytecode). uv does not compile unless asked."""
    if session.venv_backend == "uv":
        excludes = ROOT / ".nox" / "_shared_excludes.txt"
        excludes.write_text("torch\ntriton\n")
        session.install("--excludes", str(excludes), *requirements)
    else:
        session.install("--no-compile", *requirements)


def _install_shared(session: nox.Session, requirement: str, target: pathlib.Path) -> None:
    """A pinned requirement, installed once into `target` and put on each venv's path by a .pth file:
    pip then sees it as installed. Installing torch into every venv cost ~19 s each (mostly
    compiling its bytecode), ~3 minutes of the suite, and triton (1 GB, for the models' interpreted
    kernel tests) was copied into the five venvs that install plait-models' test extra; the plait
    packages are still installed per venv alone."""
    if not any(target.glob(f"{requirement.replace('==', '-')}*.dist-info")):
        if session.venv_backend == "uv":
            # uv unpacks torch in ~6 s where pip took ~35 s (a fresh clone's `nox -s train` waited
            # for it); uv reads no pip configuration, so it is given pip's find-links (where these
            # machines keep the pinned CPU wheel). Python compiles what the runs import, once.
            session.install("--target", str(target), "--upgrade", *_pip_find_links(), requirement)
        else:
            session.install("--target", str(target), "--upgrade", requirement)  # compiled once, here
    site = session.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True)
    (pathlib.Path(site.strip()) / f"_plait_shared_{target.name.strip('_')}.pth").write_text(f"{target}\n")
    if target != SHARED_TORCH:
        return
    # torch's console scripts went to SHARED_TORCH/bin with the first venv's python in their
    # shebang; each venv gets its own `torchrun` (the package READMEs launch with it), whose ranks
    # then run this venv's python and see its packages.
    torchrun = pathlib.Path(session.bin) / "torchrun"
    if not torchrun.exists():
        torchrun.write_text(f"#!{pathlib.Path(session.bin) / 'python'}\nimport sys\n"
                            "from torch.distributed.run import main\nsys.exit(main())\n")
        torchrun.chmod(0o755)


def _pip_find_links() -> list[str]:
    """`--find-links` for every folder pip's configuration names (PIP_FIND_LINKS, pip.conf)."""
    import subprocess

    links = os.environ.get("PIP_FIND_LINKS") or subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
    ).stdout.strip()
    return [arg for link in links.split() for arg in ("--find-links", link)]


# Every test session runs pytest on two pytest-xdist workers, a test file to a worker whole
# (--dist loadfile: its module fixtures, such as the parity matrix's references, are built once).
# One pytest process kept one of this 2-core machine's cores busy on average (measured 2026-12-08:
# ~1.0-1.5 cores through the package and trainer sessions); two workers fill the other, while a
# multi-rank file on its own (the parity matrix, ~1.9 cores) still has both. PLAIT_TEST_WORKERS=0
# runs a session in one process.
XDIST_REQUIREMENT = "pytest-xdist>=3.6"


def _pytest(session: nox.Session, name: str, paths: list[str], env: dict | None = None) -> None:
    REPORTS.mkdir(parents=True, exist_ok=True)
    # PYTHONDONTWRITEBYTECODE (set on the CI machines) left every process compiling the modules
    # it imports from source, as the venvs' packages are installed --no-compile: a rank's imports
    # took ~17 s instead of ~6. Cleared here, the first process to import a module caches it.
    env = {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "", **(env or {})}
    workers = os.environ.get("PLAIT_TEST_WORKERS", "2")
    xdist = ["-n", workers, "--dist", "loadfile"] if workers != "0" else []
    session.run(
        "python", "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", *xdist,
        f"--junitxml={REPORTS / name}.xml", "-o", "junit_family=xunit2",
        # Checkpoints of passed tests go at once (a suite writes several GB of them).
        "-o", "tmp_path_retention_policy=failed",
        *session.posargs, env=env,
    )


def _package_session(name: str):
    @nox.session(name=name, tags=["test"])
    def session(session: nox.Session) -> None:
        _install(session, PACKAGES[name] + [name])
        session.run("python", "-c", f"import plait.{name} as m; print('plait-{name}', m.__version__)")
        _install_packages(session, *[f"./packages/{n}" for n in TEST_ONLY.get(name, [])], XDIST_REQUIREMENT)
        tests = ROOT / "packages" / name / "tests"
        if any(tests.glob("test_*.py")):
            _pytest(session, name, [f"packages/{name}/tests"])
        else:
            (REPORTS / f"{name}.xml").unlink(missing_ok=True)
            session.log(f"plait-{name} has no tests yet (its issue has not landed): install and import checked.")

    session.__doc__ = f"plait-{name} alone: install it with what it declares, run its tests."
    return session


for _name in PACKAGES:
    globals()[f"session_{_name}"] = _package_session(_name)


@nox.session(tags=["test"])
def combos(session: nox.Session) -> None:
    """tests/: parallel packages combined with the models and each other, and the parity matrix
    (every layout vs one rank), whose report becomes the README's table (`nox -s parity_table`)."""
    _install(session, ALL)
    # pip: the lease dry run installs its wheels with this venv's pip, as on a GPU machine.
    _install_packages(session, XDIST_REQUIREMENT, *(["pip"] if session.venv_backend == "uv" else []))
    PARITY_REPORT.unlink(missing_ok=True)
    _pytest(session, "combos", ["tests"], env={"PLAIT_PARITY_REPORT": str(PARITY_REPORT)})
    if PARITY_REPORT.exists():
        session.run("python", "tools/parity_table.py", str(PARITY_REPORT))


@nox.session(python=False)
def parity_table(session: nox.Session) -> None:
    """Put the last combos run's parity matrix in the README (refused unless complete, passing, committed)."""
    session.run("python", "tools/parity_table.py", str(PARITY_REPORT), "--readme", "README.md")


@nox.session(tags=["test", "lint"])
def lint(session: nox.Session) -> None:
    """ruff over every package, the cross-package tests and this file; DESIGN.md's import layers;
    the size limits of packages/*/src."""
    session.install("ruff")
    session.run("ruff", "check", "packages", "tests", "gpu", "benchmarks", "tools", "noxfile.py")
    # DESIGN.md's import layers: allowed packages, no plait.testing at runtime, no import cycles.
    session.run("python", "tools/import_layers.py")
    # Small pieces: no file over 400 lines, no function over 60, in packages/*/src.
    session.run("python", "tools/size_limits.py")


@nox.session(python=False, tags=["test"])
def summary(session: nox.Session) -> None:
    """One line over every test session's pytest report: runs last in `nox -t test`."""
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for report in sorted(REPORTS.glob("*.xml")):
        for suite in ET.parse(report).getroot().iter("testsuite"):
            tests, failures, errors = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors"))
            skipped = int(suite.get("skipped", 0))
            totals["failed"] += failures + errors
            totals["skipped"] += skipped
            totals["passed"] += tests - failures - errors - skipped
    print(f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    if totals["failed"]:
        session.error("some tests failed")


@nox.session
def train(session: nox.Session) -> None:
    """The default run: `plait-train` with the shipped debug config (extra args go to plait-train).
    The packages are installed again only when this checkout's changed since the last `nox -s train`."""
    stamp = pathlib.Path(session.virtualenv.location) / ".plait-sources"
    sources = _sources_digest()
    if not stamp.is_file() or stamp.read_text() != sources:
        _install(session, ALL, extras="")
        stamp.write_text(sources)
    else:
        session.log("plait packages unchanged since the last install: not reinstalled")
    session.run("plait-train", *session.posargs, env={"PYTHONDONTWRITEBYTECODE": ""})  # see _pytest
    session.log(f"plait-train lives in {session.bin}: run it directly with {pathlib.Path(session.bin) / 'plait-train'} "
                "(--help lists every setting)")


def _sources_digest() -> str:
    """A digest of every package's sources and metadata: what an install would take."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((ROOT / "packages").glob("*/**/*")):
        skip = "__pycache__" in path.parts or any(part.endswith(".egg-info") for part in path.parts)
        if path.is_file() and not skip:
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark suite (benchmarks/suite.py): plait vs torchtitan 0.3.0, profiles, scaling;
    appends a dated section to benchmarks/RESULTS.md; then document masking's bench
    (benchmarks/bench_document_mask.py), the pipeline bubble bench (benchmarks/bench_pipeline.py,
    also a section in RESULTS.md), bf16 products' kernels on this CPU (benchmarks/bench_cpu_bf16.py)
    and the ops a step dispatches, plait vs torchtitan (benchmarks/bench_host_ops.py, a section in
    RESULTS.md). Not part of the tests."""
    _install(session, ALL, extras="")
    # torchtitan next to the pinned torch (the constraint keeps pip from replacing it).
    constraints = pathlib.Path(session.create_tmp()) / "torch.txt"
    constraints.write_text(TORCH + "\n")
    _install_packages(session, "-c", str(constraints), "torchtitan==0.3.0")
    session.run("python", "benchmarks/suite.py", *session.posargs)
    # Document masking: causal vs document tokens/s (1 rank, CP 2), FLOPs skipped, CP imbalance.
    session.run("python", "benchmarks/bench_document_mask.py", env={"OMP_NUM_THREADS": "1"})
    # Pipeline: idle fraction per stage per schedule vs (p - 1) / (m + p - 1), peak memory per stage.
    session.run("python", "benchmarks/bench_pipeline.py", "--results", "benchmarks/RESULTS.md", env={"OMP_NUM_THREADS": "1"})
    # bf16 products: torch's bf16 kernels vs the fp32 route plait takes on a CPU without bf16 units.
    session.run("python", "benchmarks/bench_cpu_bf16.py")
    # Host work: ops per eager step (a kernel launch each on a GPU), plait vs torchtitan, document vs causal.
    session.run("python", "benchmarks/bench_host_ops.py", "--results", "benchmarks/RESULTS.md", env={"OMP_NUM_THREADS": "1"})


@nox.session
def reliability(session: nox.Session) -> None:
    """Faults against plait-train in subprocesses (benchmarks/reliability.py): one table row each."""
    _install(session, ["mesh", "models", "dataparallel", "trainer"], extras="")
    session.run("python", "benchmarks/reliability.py", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """The GPU suite (gpu/run.py) with the python that runs nox, whose torch must be a CUDA build:
    this checkout's packages go on PYTHONPATH, nothing is installed. Without CUDA: one line, exit 0.
    `nox -s gpu -- --dry-run-cpu` runs it on the CPU (cuda_only tests skipped). Not part of -t test.
    Then the parity matrix's CUDA subset, ranks sharing the GPU (gpu/parity.py; one line per entry
    in .nox/reports/parity_cuda.jsonl)."""
    session.run("python", str(ROOT / "gpu" / "run.py"), *session.posargs)
    REPORTS.mkdir(parents=True, exist_ok=True)
    jsonl = REPORTS / "parity_cuda.jsonl"
    jsonl.unlink(missing_ok=True)
    dry = ["--dry-run-cpu"] if "--dry-run-cpu" in session.posargs else []
    session.run("python", str(ROOT / "gpu" / "parity.py"), "--jsonl", str(jsonl), *dry)
