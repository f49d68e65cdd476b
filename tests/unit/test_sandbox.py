"""The tool sandbox (spmd_rl.envs.sandbox): code that hangs, crashes, floods its output, eats
memory or reaches for the network ends as an Outcome within its limits, and the caller goes on."""

from __future__ import annotations

import socket
import time

from spmd_rl.envs.sandbox import Limits, run_python


def test_a_result_comes_back_as_text():
    out = run_python("print(sum(range(10)))")
    assert out.ok and out.output == "45\n" and out.exit_code == 0


def test_a_hang_is_cut_by_cpu_then_wall_time():
    t0 = time.monotonic()
    busy = run_python("while True: pass", Limits(wall_s=10, cpu_s=1))
    asleep = run_python("import time; time.sleep(60)", Limits(wall_s=1.5, cpu_s=5))
    assert busy.status == "killed" and asleep.status == "timeout"
    assert time.monotonic() - t0 < 8  # neither waited out its code


def test_a_crash_is_an_observation():
    err = run_python("raise ValueError('bad tool input')")
    assert err.status == "error" and "ValueError: bad tool input" in err.output
    abort = run_python("import os; os.abort()")
    assert abort.status == "killed" and abort.exit_code < 0


def test_ten_megabytes_of_output_are_cut():
    out = run_python("import sys\nwhile True: sys.stdout.write('x' * 65536)", Limits(output_bytes=1000, wall_s=10))
    assert out.status == "output_limit" and len(out.output) == 1000 and out.seconds < 5


def test_memory_is_bounded():
    out = run_python("x = bytearray(2 * 1024**3)", Limits(memory_bytes=256 * 2**20))
    assert out.status == "error" and "MemoryError" in out.output


def reached(server: socket.socket) -> bool:
    """Whether a connection arrived at this listening ``server`` within its timeout; closes it."""
    try:
        server.accept()
        return True
    except (TimeoutError, socket.timeout):
        return False
    finally:
        server.close()


def test_the_network_is_out_of_reach():
    """A server this test opened on loopback never sees the sandboxed code's connection."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    out = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    assert not reached(server) and "connected" not in out.output and out.status == "error", out
    assert out.isolation == "jail"
    allowed = run_python("print('ok')", Limits(network=True))
    assert allowed.isolation == "jail, network allowed" and allowed.ok
