"""The cluster recipes under ``examples/cluster`` are checked without a cluster.

- Every sbatch script and shell helper passes ``bash -n``; its ``#SBATCH`` directives are options
  sbatch has (a small parser of the ones we use: a typo fails), all come before the first command
  (sbatch ignores the rest), and every script asks for requeueing and a warning SIGTERM
  (``--requeue``, ``--signal=B:TERM@seconds``).
- ``run_requeueable`` (``slurm/common.sh``) forwards the batch shell's SIGTERM to the command and
  requeues the job when the signal stopped it (exit 143), not when the run ended 0 or 2.
- Every Kubernetes manifest has the fields its controller requires (:data:`REQUIRED`).
- Every ``mindspeed-*`` command line in the recipes (under torchrun ``-m mindspeed_*.cli`` or
  called by name) parses with the suite's real parser (and torchrun's flags with torchrun's),
  names an existing example recipe, and its ``key=value`` overrides are keys of that recipe's
  config (the suite's own loader, which refuses unknown keys); together they cover ``mindspeed-llm
  pretrain`` / ``sft``, ``mindspeed-mm train`` and ``mindspeed-rl grpo``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch.distributed.run import get_args_parser as torchrun_parser

from mindspeed.suite_cli import parse_suite_args
from mindspeed_llm.cli import build_parser as llm_parser
from mindspeed_llm.training.config import load_pretrain_config
from mindspeed_mm.cli import build_parser as mm_parser
from mindspeed_mm.config import load_mm_config
from mindspeed_rl.cli import build_parser as rl_parser
from mindspeed_rl.config.grpo import load_grpo_config

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "cluster"
SBATCH = sorted(CLUSTER.glob("slurm/*.sbatch"))
SHELL = [*SBATCH, *sorted(CLUSTER.glob("slurm/*.sh"))]
MANIFESTS = sorted(CLUSTER.glob("k8s/*.yaml"))

#: Fields each controller requires, as dotted paths (``[]``: every item of a list). Sources:
#: PyTorchJob (kubeflow.org/v1): the Training Operator's PyTorchJob guide and its CRD
#: (kubeflow/training-operator, manifests/base/crds/kubeflow.org_pytorchjobs.yaml): a Master with
#: one replica, Workers, each a pod template whose training container is named ``pytorch``.
#: RayJob (ray.io/v1): the KubeRay API reference (https://ray-project.github.io/kuberay/reference/api/):
#: ``entrypoint``; ``rayClusterSpec.headGroupSpec`` needs ``rayStartParams`` and ``template``;
#: each ``workerGroupSpecs`` item ``groupName``, ``replicas``, ``rayStartParams``, ``template``.
#: TrainJob (trainer.kubeflow.org/v1alpha1): the Kubeflow Trainer docs
#: (https://www.kubeflow.org/docs/components/trainer/): ``runtimeRef.name`` and ``trainer``.
REQUIRED: dict[tuple[str, str], list[str]] = {
    ("kubeflow.org/v1", "PyTorchJob"): [
        "metadata.name",
        *(
            f"spec.pytorchReplicaSpecs.{role}.{field}"
            for role in ("Master", "Worker")
            for field in (
                "replicas",
                "template.spec.containers[].name",
                "template.spec.containers[].image",
                "template.spec.containers[].command",
            )
        ),
    ],
    ("ray.io/v1", "RayJob"): [
        "metadata.name",
        "spec.entrypoint",
        "spec.rayClusterSpec.headGroupSpec.rayStartParams",
        "spec.rayClusterSpec.headGroupSpec.template.spec.containers[].name",
        "spec.rayClusterSpec.headGroupSpec.template.spec.containers[].image",
        "spec.rayClusterSpec.workerGroupSpecs[].groupName",
        "spec.rayClusterSpec.workerGroupSpecs[].replicas",
        "spec.rayClusterSpec.workerGroupSpecs[].rayStartParams",
        "spec.rayClusterSpec.workerGroupSpecs[].template.spec.containers[].name",
        "spec.rayClusterSpec.workerGroupSpecs[].template.spec.containers[].image",
    ],
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): [
        "metadata.name",
        "spec.runtimeRef.name",
        "spec.trainer.image",
        "spec.trainer.command",
    ],
}

#: The sbatch options the recipes may use (a typo is not one of them).
SBATCH_OPTIONS = argparse.ArgumentParser(prog="sbatch", add_help=False, allow_abbrev=False, exit_on_error=False)
for _name in (
    "job-name",
    "nodes",
    "ntasks-per-node",
    "cpus-per-task",
    "gpus-per-node",
    "time",
    "signal",
    "open-mode",
    "output",
    "partition",
    "account",
):
    SBATCH_OPTIONS.add_argument(f"--{_name}")
for _flag in ("exclusive", "requeue"):
    SBATCH_OPTIONS.add_argument(f"--{_flag}", action="store_true")

#: suite -> (its parser, command -> the loader of its recipe with overrides).
SUITES: dict[str, tuple[Callable[[], argparse.ArgumentParser], dict[str, Callable[..., Any]]]] = {
    "mindspeed-llm": (llm_parser, {"pretrain": load_pretrain_config, "sft": load_pretrain_config}),
    "mindspeed-mm": (mm_parser, {"train": load_mm_config}),
    "mindspeed-rl": (rl_parser, {"grpo": load_grpo_config}),
}
MODULES = {f"{suite.replace('-', '_')}.cli": suite for suite in SUITES}
SHELL_OPERATORS = {"&", "&&", "||", ";", "|"}


def missing_fields(doc: Any, path: str) -> list[str]:
    """The paths under ``doc`` that ``path`` requires and ``doc`` lacks (None, or an empty string or list)."""
    head, _, rest = path.partition(".")
    key, many = head.removesuffix("[]"), head.endswith("[]")
    value = doc.get(key) if isinstance(doc, dict) else None
    if value is None or value == "" or value == []:
        return [key]
    if many:
        if not isinstance(value, list):
            return [f"{key} (not a list)"]
        return [f"{key}[{i}].{m}" for i, item in enumerate(value) for m in (missing_fields(item, rest) if rest else [])]
    return [f"{key}.{m}" for m in missing_fields(value, rest)] if rest else []


def resolve_shell(token: str) -> str:
    """``${NAME:-default}`` -> default; any other ``${NAME}`` -> NAME (a placeholder string)."""
    token = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", token)
    return re.sub(r"\$\{(\w+)\}", r"\1", token)


def shell_lines(text: str) -> Iterator[list[str]]:
    """The commands of a shell script as tokens (continuations joined, comments dropped)."""
    for line in text.replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            yield shlex.split(line, comments=True)


def invocations(tokens: list[str]) -> Iterator[tuple[str, list[str], list[str]]]:
    """``(suite, its arguments, torchrun's arguments)`` of every mindspeed command in ``tokens``."""
    segment: list[str] = []
    for token in [*tokens, ";"]:
        if token not in SHELL_OPERATORS:
            segment.append(resolve_shell(token))
            continue
        if "torchrun" in segment:
            launcher = segment[segment.index("torchrun") + 1 :]
            args = torchrun_parser().parse_args(launcher)
            assert args.module and args.training_script in MODULES, f"torchrun runs {args.training_script}"
            yield MODULES[args.training_script], list(args.training_script_args), launcher
        else:
            for suite in SUITES:
                if suite in segment:
                    yield suite, segment[segment.index(suite) + 1 :], []
        segment = []


def manifest_commands(doc: dict[str, Any]) -> Iterator[list[str]]:
    """The command lines of a manifest's containers, its trainer and its entrypoint."""
    spec = doc["spec"]
    if "entrypoint" in spec:
        yield shlex.split(spec["entrypoint"])
    if "trainer" in spec:
        yield [*spec["trainer"].get("command", []), *spec["trainer"].get("args", [])]
    for replica in spec.get("pytorchReplicaSpecs", {}).values():
        for container in replica["template"]["spec"]["containers"]:
            yield [*container.get("command", []), *container.get("args", [])]


def all_commands() -> list[tuple[str, list[str], list[str], str]]:
    found = []
    for script in SHELL:
        for tokens in shell_lines(script.read_text()):
            found += [(*call, script.name) for call in invocations(tokens)]
    for manifest in MANIFESTS:
        for tokens in manifest_commands(yaml.safe_load(manifest.read_text())):
            found += [(*call, manifest.name) for call in invocations(tokens)]
    return found


def test_there_are_recipes_of_each_kind() -> None:
    names = {p.name for p in [*SBATCH, *MANIFESTS]}
    assert {"llm_pretrain.sbatch", "llm_sft.sbatch", "mm_train.sbatch", "rl_grpo.sbatch"} <= names
    kinds = {(d["apiVersion"], d["kind"]) for d in map(yaml.safe_load, (m.read_text() for m in MANIFESTS))}
    assert kinds == set(REQUIRED), kinds


@pytest.mark.parametrize("script", SHELL, ids=lambda p: p.name)
def test_shell_scripts_parse(script: Path) -> None:
    run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    for tokens in shell_lines(script.read_text()):
        if tokens and tokens[0] in ("source", "."):  # a sourced helper exists where sbatch runs it
            assert (ROOT / tokens[1].replace("${SLURM_SUBMIT_DIR}/", "")).is_file(), tokens


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_sbatch_directives(script: Path) -> None:
    lines = script.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    late = [line for line in lines[first_command:] if line.startswith("#SBATCH")]
    assert not late, f"sbatch ignores directives after the first command: {late}"
    directives = [arg for line in lines if line.startswith("#SBATCH") for arg in shlex.split(line[7:], comments=True)]
    try:
        options, unknown = SBATCH_OPTIONS.parse_known_args(directives)
    except argparse.ArgumentError as err:
        pytest.fail(f"{script.name}: {err}")
    assert not unknown, f"{script.name}: not sbatch options of ours: {unknown}"
    assert options.requeue and re.fullmatch(r"B:TERM@\d+", options.signal or ""), options
    assert int(options.nodes) >= 2 and options.ntasks_per_node == "1", options


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifests_have_what_their_controller_requires(manifest: Path) -> None:
    doc = yaml.safe_load(manifest.read_text())
    kind = (doc.get("apiVersion"), doc.get("kind"))
    assert kind in REQUIRED, f"{manifest.name}: no schema for {kind}"
    missing = [m for path in REQUIRED[kind] for m in missing_fields(doc, path)]
    assert not missing, f"{manifest.name} lacks {missing}"
    if doc["kind"] == "PyTorchJob":  # the operator finds the training container by this name
        replicas = doc["spec"]["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] == 1
        for replica in replicas.values():
            assert "pytorch" in [c["name"] for c in replica["template"]["spec"]["containers"]]


def test_missing_fields_finds_what_is_missing() -> None:
    doc = {"spec": {"groups": [{"name": "a", "template": {}}, {"template": {"image": ""}}]}}
    assert missing_fields(doc, "spec.groups[].name") == ["spec.groups[1].name"]
    assert missing_fields(doc, "spec.groups[].template.image") == [
        "spec.groups[0].template.image",
        "spec.groups[1].template.image",
    ]
    assert missing_fields(doc, "metadata.name") == ["metadata"]


def test_every_command_line_parses_and_names_a_recipe() -> None:
    commands = all_commands()
    covered = set()
    for suite, argv, _launcher, where in commands:
        build, loaders = SUITES[suite]
        try:
            args = parse_suite_args(build(), argv)
        except SystemExit:
            pytest.fail(f"{where}: `{suite} {shlex.join(argv)}` does not parse")
        assert args.command in loaders, f"{where}: {suite} {args.command} has no loader here"
        config = Path(args.config)
        recipe = ROOT / config.as_posix()[config.as_posix().index("examples/") :]
        assert recipe.is_file(), f"{where}: --config {args.config} names no example recipe"
        loaders[args.command](str(recipe), args.overrides)  # unknown override keys raise
        assert any(o.startswith("checkpoint.save=") for o in args.overrides), f"{where}: no shared checkpoint.save"
        if suite == "mindspeed-rl":  # joins the cluster rather than starting a local Ray
            assert any(o.startswith("ray.address=") for o in args.overrides), where
        covered.add((suite, args.command))
    assert covered == {(s, c) for s, (_, loaders) in SUITES.items() for c in loaders}, covered
    under_torchrun = {where for _, _, launcher, where in commands if launcher}
    assert under_torchrun == {p.name for p in [*SBATCH, *MANIFESTS] if "rl_" not in p.name}


def _requeue_run(tmp_path: Path, command: str, send_term: bool) -> tuple[int, str]:
    """``run_requeueable`` of common.sh in a batch-like bash with a fake ``scontrol``; its status and the calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)
    script = f"source {CLUSTER}/slurm/common.sh; run_requeueable bash -c {shlex.quote(command)}"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "READY": str(ready)}
    shell = subprocess.Popen(["bash", "-c", script], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if send_term:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        shell.send_signal(signal.SIGTERM)
    try:
        shell.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, signal.SIGKILL)  # the command never ended: SIGTERM did not reach it
        shell.communicate()
        pytest.fail(f"`{command}` was still running 30 s after SIGTERM")
    return shell.returncode, calls.read_text() if calls.exists() else ""


def test_run_requeueable_forwards_sigterm_and_requeues(tmp_path: Path) -> None:
    # As our commands do: SIGTERM -> save -> exit 143 (a trainer that ignored the forward would never end).
    trainer = 'trap "exit 143" TERM; touch "$READY"; while :; do sleep 0.05; done'
    assert _requeue_run(tmp_path, trainer, send_term=True) == (143, "requeue 42\n")
    (tmp_path / "scontrol.calls").unlink()
    user_error = 'trap "exit 2" TERM; touch "$READY"; while :; do sleep 0.05; done'
    assert _requeue_run(tmp_path, user_error, send_term=True) == (2, "")
    assert _requeue_run(tmp_path, "exit 0", send_term=False) == (0, "")
    assert _requeue_run(tmp_path, "exit 143", send_term=False) == (143, "")  # no SIGTERM from Slurm: no requeue
