"""Importing any mindspeed package or submodule changes no global state.

Checked in a fresh interpreter: no torch attribute replaced, no environment variable
written, ``sys.argv`` never read, no logging handler installed outside our loggers, no
warnings filter, no torch function mode, default dtype, threads and grad mode unchanged; and
``import mindspeed`` with the run plumbing (launcher, metrics log, checkpoint I/O, report) loads
neither TensorBoard, matplotlib nor megatron-core (the core declares the first two for the
metrics log, which imports them when a run opens it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    r"""
    import importlib, json, logging, os, pkgutil, sys, warnings
    import torch, torch.nn.functional, torch.distributed
    # torch's own lazy initialisation, not ours: importing torch._dynamo (which megatron-core and
    # torch.compile do) wraps torch.manual_seed. Load it before the snapshot.
    import torch._dynamo
    # Third-party import-time filters are theirs, not ours: diffusers' Wan pipeline module (the
    # DiT encoders take its prompt cleaner) pulls in libraries that add warnings filters.
    import diffusers.pipelines.wan.pipeline_wan

    class WatchedArgv(list):
        reads = 0
        def _touch(self):
            WatchedArgv.reads += 1
        def __getitem__(self, i): self._touch(); return list.__getitem__(self, i)
        def __iter__(self): self._touch(); return list.__iter__(self)
        def __len__(self): self._touch(); return list.__len__(self)
        def __contains__(self, x): self._touch(); return list.__contains__(self, x)
    sys.argv = WatchedArgv(["probe"])

    WATCHED = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module,
               "torch.nn.functional": torch.nn.functional, "torch.distributed": torch.distributed,
               "torch.autograd": torch.autograd, "torch.cuda": torch.cuda}

    def snapshot():
        out = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for n, m in WATCHED.items():
                for a in dir(m):  # dir(): inherited attributes too (Tensor methods live on TensorBase)
                    if a.startswith("__"):
                        continue
                    try:
                        out[f"{n}.{a}"] = id(getattr(m, a))
                    except Exception:
                        pass
        return out

    def state():
        return {
            "env": dict(os.environ),
            "root_handlers": len(logging.getLogger().handlers),
            "warning_filters": len(warnings.filters),
            "dtype": str(torch.get_default_dtype()),
            "threads": torch.get_num_threads(),
            "grad": torch.is_grad_enabled(),
            "function_modes": torch._C._len_torch_function_stack(),
            "rng": torch.get_rng_state().sum().item(),
        }

    before_attrs, before = snapshot(), state()
    # The core's run plumbing declares TensorBoard and matplotlib for the metrics log and imports
    # them when a run opens it (megatron-core's own modules load TensorBoard: not these).
    for name in ("mindspeed", "mindspeed.launch", "mindspeed.metrics.log", "mindspeed.metrics.trackers",
                 "mindspeed.metrics.report", "mindspeed.checkpointing.atomic", "mindspeed.checkpointing.safetensors_io"):
        importlib.import_module(name)
    heavy = sorted(m for m in ("tensorboard", "matplotlib", "megatron") if m in sys.modules)
    imported = []
    for top in ("mindspeed", "mindspeed_llm", "mindspeed_mm", "mindspeed_rl"):
        package = importlib.import_module(top)
        imported.append(top)
        for info in pkgutil.walk_packages(package.__path__, top + "."):
            importlib.import_module(info.name)
            imported.append(info.name)
    after_attrs, after = snapshot(), state()
    changed = sorted(k for k in before_attrs if k in after_attrs and before_attrs[k] != after_attrs[k])
    # New attributes on torch classes would be monkey-patching; new torch submodules are fine.
    added = sorted(k for k in after_attrs if k not in before_attrs
                   and k.startswith(("torch.Tensor.", "torch.nn.Module.", "torch.nn.functional.", "torch.cuda.")))
    env_diff = sorted(set(before["env"].items()) ^ set(after["env"].items()))
    print(json.dumps({
        "imported": imported, "heavy": heavy, "changed": changed, "added": added,
        "env_diff": [k for k, _ in env_diff], "argv_reads": WatchedArgv.reads,
        "state_before": {k: v for k, v in before.items() if k != "env"},
        "state_after": {k: v for k, v in after.items() if k != "env"},
    }))
    """
)


def test_imports_change_no_global_state() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"mindspeed", "mindspeed.ops", "mindspeed.device", "mindspeed_llm", "mindspeed_rl"} <= set(
        report["imported"]
    )
    assert report["changed"] == [], f"torch attributes replaced on import: {report['changed']}"
    assert report["added"] == [], f"attributes added to torch classes on import: {report['added']}"
    assert report["env_diff"] == [], f"environment changed on import: {report['env_diff']}"
    assert report["argv_reads"] == 0, "sys.argv was read during import"
    assert report["heavy"] == [], f"import mindspeed and its run plumbing load {report['heavy']}: import them lazily"
    assert report["state_after"] == report["state_before"]


def test_probe_detects_a_patch() -> None:
    # The probe must be able to fail: a module that patches torch at import is caught.
    probe = PROBE.replace(
        'for top in ("mindspeed", "mindspeed_llm", "mindspeed_mm", "mindspeed_rl"):', "for top in ():"
    )
    probe = probe.replace(
        "before_attrs, before = snapshot(), state()",
        "before_attrs, before = snapshot(), state()\ntorch.Tensor.cuda = lambda self: self\nos.environ['X_PROBE'] = '1'\nlen(sys.argv)",
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["changed"] == ["torch.Tensor.cuda"]
    assert report["env_diff"] == ["X_PROBE"]
    assert report["argv_reads"] >= 1
