"""The sandbox's limits hold: a normal run, timeouts that kill every process, memory, CPU, output,
the environment, the working directory, the network; and no model input makes the tool raise.

Cheap by design: each run is one ``python -I -S`` start (about 40 ms); the one CPU-bound case
spends its 1 s of CPU limit; the timeouts wait on the wall clock, not the CPU.
"""

from __future__ import annotations

import random
import signal
import socket
import time
from pathlib import Path

from mindspeed_rl.tools import SandboxLimits, ToolCall, build_python, call_tool, execute_calls, run_python

# Wall limits are generous: a loaded CI machine may take seconds to start a process.
FAST = SandboxLimits(wall_timeout_s=10.0, cpu_seconds=2, memory_mb=256, max_output_bytes=200)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie awaiting its reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_normal_program_and_its_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MINDSPEED_TEST_SECRET", "hunter2")
    code = (
        "import os, sys\n"
        "open('note.txt', 'w').write('kept')\n"
        "print(open('note.txt').read(), sum(range(10)))\n"
        "print(os.getcwd())\n"
        "print(os.environ.get('MINDSPEED_TEST_SECRET'), 'hunter2' in open('/proc/self/environ').read())\n"
        "print(sys.flags.isolated, sys.flags.no_site)\n"
    )
    result = run_python(code, FAST)
    lines = result.output.splitlines()
    assert result.returncode == 0 and not result.timed_out and not result.truncated, result
    assert lines[0] == "kept 45"
    workdir = Path(lines[1])
    assert workdir.name.startswith("mindspeed-sandbox-") and not workdir.exists(), "the working dir is removed"
    assert not Path(f"{workdir}.out").exists()
    assert lines[2] == "None False", "the caller's environment never reaches the program"
    assert lines[3] == "1 1"
    tool = build_python(wall_timeout_s=10.0)
    assert call_tool(tool, "python", {"code": "print(6 * 7)"}).content == "42\n"
    assert call_tool(tool, "python", {"code": "pass"}).content == "(no output)"


def test_timeout_kills_the_group_and_children_that_left_it() -> None:
    code = (
        "import os, signal, time\n"
        # One write per line: with -u, print writes the words and the newline separately, and two
        # processes sharing the pipe once interleaved them ("escapedchild 2911529114").
        "say = lambda *words: os.write(1, (' '.join(map(str, words)) + '\\n').encode())\n"
        "say('parent', os.getpid())\n"
        "say('dir', os.getcwd())\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "if os.fork() == 0:\n"  # stays in the group, ignores SIGTERM
        "    say('child', os.getpid())\n"
        "    while True: time.sleep(0.05)\n"
        "if os.fork() == 0:\n"  # leaves the group: found by its environment token
        "    os.setsid()\n"
        "    say('escaped', os.getpid())\n"
        "    while True: time.sleep(0.05)\n"
        "while True: time.sleep(0.05)\n"
    )
    # A wall limit that a loaded 2-core CI host still reaches after start-up and both forks (at
    # 2 s the whole-suite run once killed the program before it printed anything).
    start = time.perf_counter()
    result = run_python(code, SandboxLimits(wall_timeout_s=6.0))
    assert result.timed_out and result.returncode == -signal.SIGKILL, result
    assert time.perf_counter() - start < 20.0
    fields = dict(line.split(" ", 1) for line in result.output.splitlines() if " " in line)
    assert not Path(fields.pop("dir")).exists(), "the working dir is removed after a timeout too"
    pids = {name: int(pid) for name, pid in fields.items()}
    assert set(pids) == {"child", "escaped", "parent"}, result.output
    deadline = time.monotonic() + 2.0
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [name for name, pid in pids.items() if alive(pid)], "every process of the run is dead"
    text = call_tool(build_python(wall_timeout_s=0.3), "python", {"code": "while True: pass"})
    assert not text.ok and text.error == "timeout" and "timed out after 0.3 s" in text.content


def test_memory_cpu_and_output_limits() -> None:
    tool = build_python(wall_timeout_s=30.0, cpu_seconds=1, memory_mb=128, max_output_bytes=100)
    calls = [
        ToolCall("python", {"code": "x = bytearray(10**9)\nprint(len(x))"}),
        ToolCall("python", {"code": "while True: pass"}),
        ToolCall("python", {"code": "print('a' * 5000 + 'b' * 5000)"}),
        ToolCall("python", {"code": "print('x' * 10**6)"}),
        ToolCall("python", {"code": "import sys\nsys.exit(3)"}),
        ToolCall("python", {"code": "raise ValueError('boom')"}),
    ]
    start = time.perf_counter()
    memory, cpu, output, flood, status, exception = execute_calls(calls, {"python": tool}, max_parallel=6)
    assert not memory.ok and memory.error == "exit_status" and "MemoryError" in memory.content, memory
    assert not cpu.ok and cpu.error == "cpu_limit" and "CPU time limit of 1 s" in cpu.content, cpu
    assert output.ok and output.content == "a" * 50 + "\n...\n" + "b" * 49 + "\n" + (
        "\n[output truncated to its first and last 50 bytes]"
    ), output.content
    assert not flood.ok and flood.error == "output_limit" and "its later writes failed" in flood.content, flood
    assert not status.ok and status.content == "(no output)\n[exit status 3]"
    assert not exception.ok and "ValueError: boom" in exception.content
    assert time.perf_counter() - start < 30.0


def test_network_is_unreachable_where_a_namespace_can_be_made() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = (
            f"import socket\ns = socket.socket()\ns.settimeout(1)\n"
            f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('connected')\n"
            f"except OSError as err:\n    print('refused', err.errno)\n"
        )
        result = run_python(code, FAST)
    finally:
        server.close()
    # Where the kernel refuses a namespace (no capability, no user namespaces) the sandbox says
    # so; here, and in CI's containers, it can make one and the host's loopback is out of reach.
    assert result.output.startswith("refused" if result.network_isolated else "connected"), result
    if not result.network_isolated:
        refused = run_python("print(1)", SandboxLimits(require_network_isolation=True))
        assert refused.returncode == 126


def test_no_input_escapes_as_an_exception() -> None:
    """Garbage arguments of every type and random programs: always a result, never a raise."""
    rng = random.Random(1)
    tool = build_python(wall_timeout_s=2.0, cpu_seconds=1, max_output_bytes=64)
    alphabet = "()[]{}:;'\"\\\n\t #=+-*/%@!~^&|<>,.0123456789abcdefxyz_\x00\udcff"
    garbage = [None, 1, 1.5, True, [], {}, {"code": 1}, {"code": None}, {"cod": "1"}, {"code": "1", "x": 2}, "code"]
    garbage += [{"code": "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))} for _ in range(200)]
    results = [call_tool(tool, "python", args) for args in garbage[:11]]
    assert all(not r.ok and r.error == "bad_arguments" for r in results), results
    programs = [ToolCall("python", args) for args in garbage[11:]]
    ran = execute_calls(programs[:24], {"python": tool}, max_parallel=4)
    assert len(ran) == 24 and all(isinstance(r.content, str) for r in ran)
    assert sum(r.ok for r in ran) + sum(not r.ok for r in ran) == 24
    # The other 176 random texts through the calculator (no subprocess): a result each.
    from mindspeed_rl.tools import build_calculator

    calculator = build_calculator()
    for args in programs[24:]:
        result = call_tool(calculator, "calculator", {"expression": args.arguments["code"]})
        assert isinstance(result.content, str) and (result.ok or result.content.startswith("error:"))
