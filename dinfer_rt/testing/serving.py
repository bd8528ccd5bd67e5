"""A ``dinfer-rt serve`` subprocess on a free localhost port, bounded in time: used by the server
tests and ``benchmarks/serve_bench.py``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminal_signals() -> None:
    """In a child before exec: SIGINT's default action, as a command started from a terminal has
    (a runner that started this process in the background may have left SIGINT ignored, which
    exec would carry over and Python would then keep)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServerProcess:
    """Start the server (``launcher`` replaces ``python -m dinfer_rt``), wait for ``/health``."""

    def __init__(
        self,
        *args: str,
        launcher: list[str] | None = None,
        lifetime: float = 300,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 120,
    ) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*(launcher or [sys.executable, "-m", "dinfer_rt"]), "serve", "--port", str(self.port)]
        cmd += ["--shutdown-after-s", str(lifetime), *args]
        self.proc = subprocess.Popen(  # its own process group with Ctrl-C's default action, as from a terminal
            cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True, preexec_fn=terminal_signals,
        )  # fmt: skip
        deadline = time.time() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become healthy in {ready_timeout} s")
            time.sleep(0.2)

    def metric(self, name: str) -> float:
        """Sum of the samples of one Prometheus metric (``name`` may include labels)."""
        import httpx

        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def interrupt(self) -> None:
        """A terminal's Ctrl-C: SIGINT to the server's whole process group (its workers too)."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def openai_client(self, timeout: float = 120):
        """The official ``openai`` client on this server, with no retries (a test sees every error)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def chats(self, contents: list[str], **body) -> list[str]:
        """One single-turn chat per content, sent at once (the official client, one thread each);
        the answers in the same order. ``body``: extra request fields."""
        from concurrent.futures import ThreadPoolExecutor

        client = self.openai_client()
        model = client.models.list().data[0].id

        def ask(content: str) -> str:
            messages = [{"role": "user", "content": content}]
            r = client.chat.completions.create(model=model, messages=messages, extra_body=body or None)
            return r.choices[0].message.content

        with ThreadPoolExecutor(max(1, len(contents))) as pool:
            return list(pool.map(ask, contents))
