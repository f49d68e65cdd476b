"""``reward.kind: remote`` (``rewards.remote``) against a small HTTP server the test runs on
loopback: the chunk's responses, answers and rows arrive with the bearer token from the
environment, scores come back in order, a flaky service is retried, and a service that hangs,
answers garbage or refuses scores the failure value through the pool and is counted: the rank
is never stalled."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spmd_rl.rewards.pool import RewardPool
from spmd_rl.rewards.remote import RemoteReward, RewardServiceError

NEVER = threading.Event()


class Judge(BaseHTTPRequestHandler):
    seen: list = []
    flaky_left = [0]

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Judge.seen.append((self.path, self.headers.get("Authorization"), body))
        if self.path == "/hang":
            NEVER.wait(30)
        if self.path == "/flaky" and Judge.flaky_left[0] > 0:
            Judge.flaky_left[0] -= 1
            return self._reply(503, b"busy")
        if self.path == "/denied":
            return self._reply(401, b"no")
        if self.path == "/garbage":
            return self._reply(200, b"<html>not json</html>")
        scores = [{"score": float(r == a), "chars": len(r)} for r, a in zip(body["responses"], body["answers"])]
        self._reply(200, json.dumps({"scores": scores}).encode())

    def _reply(self, code: int, raw: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Judge.seen.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


ROWS = [{"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "arith", "extra_info": {"k": 1}}] * 4


def _pool(url, timeout_s=5.0, retries=2):
    remote = RemoteReward(url, timeout_s, retries, "JUDGE_TOKEN", backoff_s=0.01)
    return RewardPool(remote, url, workers=2, timeout_s=timeout_s, failure_score=-1.0, batched=True)


def test_scores_come_back_in_order_with_the_token_and_the_rows(judge, monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", "s3cret")
    got = _pool(f"{judge}/ok").score(["2", "3", "2", "x"], ["2", "2", "2", "2"], ROWS)
    assert got.scores == [1.0, 0.0, 1.0, 0.0] and got.metrics[3] == {"chars": 1.0} and got.failures == 0
    assert len(Judge.seen) == 2 and {a for _, a, _ in Judge.seen} == {"Bearer s3cret"}  # two chunks, two workers
    assert Judge.seen[0][2]["rows"][0] == ROWS[0]


def test_a_flaky_service_is_retried_and_a_refusing_one_is_not(judge):
    Judge.flaky_left[0] = 2
    assert RemoteReward(f"{judge}/flaky", 5.0, 2, "UNSET_TOKEN", backoff_s=0.01)(["1"], ["1"], ROWS[:1]) == [
        {"score": 1.0, "chars": 1}
    ]
    assert Judge.seen[-1][1] is None  # no token in the environment: no Authorization header
    Judge.seen.clear()
    with pytest.raises(RewardServiceError, match=r"/denied: HTTP 401 .*after 1 attempt"):
        RemoteReward(f"{judge}/denied", 5.0, 3, "UNSET_TOKEN", backoff_s=0.01)(["1"], ["1"], ROWS[:1])
    assert len(Judge.seen) == 1


def test_garbage_and_hanging_services_score_the_failure_value_and_are_counted(judge):
    garbage = _pool(f"{judge}/garbage", retries=1).score(["1", "2"], ["1", "2"], ROWS[:2])
    assert garbage.scores == [-1.0, -1.0] and garbage.failures == 2 and len(Judge.seen) == 4  # 2 chunks x 2 tries
    assert "the reply is not {'scores'" in garbage.first_error
    hung = _pool(f"{judge}/hang", timeout_s=0.5, retries=0).score(["1", "2"], ["1", "2"], ROWS[:2])
    assert hung.scores == [-1.0, -1.0] and hung.failures + hung.timeouts == 2


def test_the_run_builds_the_service_from_the_reward_section(in_repo, monkeypatch):
    from spmd_rl.config.loader import load_config
    from spmd_rl.rewards import reward_for
    from spmd_rl.rewards.pool import pool_of

    over = ["reward.kind=remote", "reward.url=http://judge:8000/score", "reward.retries=5", "reward.token_env=MY_TOK"]
    monkeypatch.setenv("MY_TOK", "t0k")
    r = load_config("configs/quickstart.yaml", over).reward
    fn = reward_for(r)
    assert isinstance(fn, RemoteReward) and (fn.url, fn.retries) == ("http://judge:8000/score", 5)
    assert fn.headers["Authorization"] == "Bearer t0k"
    assert pool_of(r, fn).batched
