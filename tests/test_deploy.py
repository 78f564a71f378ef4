"""docker-compose.yml and the Dockerfile, checked against the real CLI (no Docker engine here)."""

from __future__ import annotations

import re
import shlex
import tomllib

import pytest
import yaml

from tally.audit.cli import parse
from tally.trainer import host
from tests.support import ROOT


def _expand(arg: str) -> str:
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m.group(2), arg)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_share_one_volume_and_the_project_image(compose):
    services = compose["services"]
    assert {"api", "trainer", "reconcile", "scheduler", "worker"} <= set(services)
    assert set(compose["volumes"]) == {"tally-data"}
    for name, svc in services.items():
        assert svc["build"] == ".", name
        assert "tally-data:/data" in svc["volumes"], name
    assert services["trainer"]["deploy"]["replicas"] > 1
    assert services["worker"]["deploy"]["replicas"] > 1
    assert services["api"]["ports"] == ["127.0.0.1:8000:8000"]


@pytest.mark.slow
def test_every_command_parses_with_the_real_cli(compose):
    services = compose["services"]
    for name in ("api", "reconcile"):
        args = parse([_expand(a) for a in services[name]["command"]])
        assert args.command == {"api": "serve", "reconcile": "reconcile"}[name]
    paths = {"api": parse(services["api"]["command"]),
             "reconcile": parse(services["reconcile"]["command"])}
    assert paths["api"].spool == "/data/spool" and paths["api"].host == "0.0.0.0"
    assert paths["reconcile"].output == paths["api"].reports  # the API serves its report
    prepare = services["prepare"]["command"][0]
    for part in prepare.split("&&"):
        words = shlex.split(part)
        assert words[0] == "tally"
        paths[words[1]] = parse(words[1:])
    assert services["trainer"]["entrypoint"] == ["python", "-m", "tally.trainer.host"]
    targs = host.build_parser().parse_args([_expand(a) for a in services["trainer"]["command"]])
    assert targs.rendezvous == "trainer" and targs.hosts == \
        services["trainer"]["deploy"]["replicas"]
    from tally.trainer.config import TrainConfig

    cfg = TrainConfig.load(None, targs.overrides)
    assert cfg.spool == paths["api"].spool and cfg.corpus == "/data/corpus"
    assert paths["manifest"].output == paths["api"].manifest == paths["reconcile"].manifest


def _dask_cli(words: list[str]):
    """`dask <sub> ARGS` parsed by the real `dask` command line (its click commands, found as
    the `dask` script finds them), without running it."""
    from importlib.metadata import entry_points

    assert words[0] == "dask"
    (command,) = [e.load() for e in entry_points(group="dask_cli") if e.name == words[1]]
    ctx = command.make_context(f"dask {words[1]}", list(words[2:]))
    # Both commands pass unknown options on to preload scripts: none may be left over.
    assert not ctx.params.get("preload_argv"), words
    return ctx.params


def test_the_jobs_submit_to_the_compose_dask_cluster(compose):
    import dask
    from dask.utils import parse_timedelta

    services = compose["services"]
    sched, worker = services["scheduler"], services["worker"]
    sargs = _dask_cli(sched["entrypoint"] + sched["command"])
    wargs = _dask_cli(worker["entrypoint"] + worker["command"])
    address = f"tcp://scheduler:{sargs['port']}"
    assert wargs["scheduler"] == address and wargs["nthreads"] == 1
    assert not wargs["local_directory"].startswith("/data")  # scratch off the shared volume
    # The scheduler's health check knocks on the port the workers and the jobs use.
    assert str(sargs["port"]) in " ".join(sched["healthcheck"]["test"])
    timeout = dask.config.collect_env(sched["environment"])["distributed"]["scheduler"]
    assert parse_timedelta(timeout["no_workers_timeout"]) > 0
    jobs = {"reconcile": services["reconcile"]["command"],
            "manifest": shlex.split(services["prepare"]["command"][0].split("&&")[1])[1:]}
    for name, argv in jobs.items():
        args = parse(argv)
        assert args.command == name and args.runner == "dask" and args.dask_address == address
    for name in ("prepare", "reconcile"):
        deps = services[name]["depends_on"]
        assert deps["scheduler"]["condition"] == "service_healthy" and "worker" in deps, name
    assert services["worker"]["depends_on"]["scheduler"]["condition"] == "service_healthy"


def test_dockerfile_copies_what_exists_and_runs_the_console_script():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    copies = [shlex.split(line)[1:-1] for line in lines if line.startswith("COPY ")]
    sources = [s for c in copies for s in c]
    assert sources and all((ROOT / s).exists() for s in sources)
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for folder in packages["tool"]["setuptools"]["package-dir"].values():
        assert folder in sources
    assert 'ENTRYPOINT ["tally"]' in lines
    assert packages["project"]["scripts"]["tally"] == "tally.audit.cli:main"


def test_the_beam_pin_is_the_sdk_harness_release():
    """The beam extra pins the release Dockerfile.sdk builds its harness from: a looser range
    let a fresh install take a newer Beam than the image the manual names."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["beam"]
    (pin,) = [d for d in extra if d.startswith("apache-beam")]
    lines = (ROOT / "Dockerfile.sdk").read_text().splitlines()
    (arg,) = [line for line in lines if line.startswith("ARG BEAM_VERSION=")]
    assert pin == "apache-beam==" + arg.split("=", 1)[1]


@pytest.mark.slow
def test_the_sdk_harness_image_is_beams_at_the_installed_version_with_tally():
    import sys

    import apache_beam

    lines = (ROOT / "Dockerfile.sdk").read_text().splitlines()
    (arg,) = [line for line in lines if line.startswith("ARG BEAM_VERSION=")]
    assert arg.split("=", 1)[1] == apache_beam.__version__
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"FROM apache/beam_python{python}_sdk:${{BEAM_VERSION}}" in lines
    copies = [shlex.split(line)[1:-1] for line in lines if line.startswith("COPY ")]
    sources = [s for c in copies for s in c]
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for folder in packages["tool"]["setuptools"]["package-dir"].values():
        assert folder in sources
    assert all((ROOT / s).exists() for s in sources)
    assert any(line.startswith("RUN pip install") and '"apache-beam==${BEAM_VERSION}"' in line
               for line in lines)
    # Beam's boot loader stays the entry point: runners start it as the harness.
    assert not any(line.startswith(("ENTRYPOINT", "CMD")) for line in lines)


def test_cluster_runner_commands_run_the_work_on_the_cluster():
    """The manual's reconcile commands for Flink, Spark and Dataflow put Tally's steps in the SDK
    image (an EXTERNAL worker pool of it, or Dataflow's custom container), never in the
    submitting process (LOOPBACK), and give the job-server jar as a local file."""
    import apache_beam
    from apache_beam.options.pipeline_options import (
        FlinkRunnerOptions,
        PipelineOptions,
        PortableOptions,
        SparkRunnerOptions,
        WorkerOptions,
    )

    from tests.test_readme import blocks

    runs = {}
    for _, attrs, code in blocks():
        for words in map(shlex.split, code.splitlines() if attrs == "cluster" else []):
            if words[:2] == ["tally", "reconcile"]:
                args = parse(words[1:])
                runs[args.runner] = PipelineOptions(args.beam_args)
    assert {"dask", "FlinkRunner", "SparkRunner", "DataflowRunner"} <= set(runs)
    image = f"tally-beam-sdk:{apache_beam.__version__}"
    jars = {"FlinkRunner": runs["FlinkRunner"].view_as(FlinkRunnerOptions).flink_job_server_jar,
            "SparkRunner": runs["SparkRunner"].view_as(SparkRunnerOptions).spark_job_server_jar}
    for runner in ("FlinkRunner", "SparkRunner"):
        env = runs[runner].view_as(PortableOptions)
        assert env.environment_type == "EXTERNAL" and env.environment_config, runner
        assert jars[runner].startswith("/") and jars[runner].endswith(".jar"), runner
    assert runs["DataflowRunner"].view_as(WorkerOptions).sdk_container_image.endswith(
        "/" + image)
    assert runs["DataflowRunner"].view_as(PortableOptions).environment_type is None
    guide = (ROOT / "docs" / "guides" / "deployment.md").read_text()
    assert f"docker build -f Dockerfile.sdk -t {image} ." in guide
    assert f"{image} --worker_pool" in guide


def test_rendezvous_rank_orders_addresses_numerically():
    addrs = ["10.0.0.10", "10.0.0.9", "10.0.0.2", "10.0.0.9"]
    assert host.rank("10.0.0.9", addrs) == (1, "10.0.0.2")
    assert host.rank("10.0.0.10", addrs) == (2, "10.0.0.2")
    with pytest.raises(Exception, match="not among"):
        host.rank("10.0.0.3", addrs)
    assert host.rendezvous("localhost", 1, 12999, timeout_s=5) == (0, "127.0.0.1:12999")
