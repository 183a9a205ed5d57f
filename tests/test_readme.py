"""Every command line in README.md's ```sh blocks, run as a newcomer would.

The README is parsed, not copied: each line of a ```sh block (comments stripped,
backslash continuations joined) is classified as `make up` / `make test`, a curl
against the router, `tandem up ...`, one service of a hand-started cluster
(`tandem prefill|decode|router ...`) or `tandem generate ...`. A line of any other
kind fails test_every_command_is_known, so a new README command cannot go untested.

What differs from a terminal, and why:
  * ports: every port a command names or listens on by default (8000, 9001, ...) is
    mapped to a free one, the same map for a cluster and the curl lines run
    against it, so tests never collide with each other or a running cluster;
  * workers get --ready-file so we know when they serve;
  * `tandem generate` runs with --max-tokens 4 (a newcomer's output, sooner);
  * a curl whose JSON body sets no max_tokens gets "max_tokens": 8, as the
    completions curl asks for: otherwise the router's default of 256 tokens,
    sampled at temperature 1 so often all of them, took over 4 minutes for one
    request on a loaded 2-core machine;
  * `make up` is not run: we check the Makefile's `up` recipe is `tandem up` and run
    that (make would also build the venv); `make test` is this suite, never run here;
  * --model is added only when the embedded model is not where the README's
    commands look for it (TANDEM_MODEL pointing elsewhere).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tandem.supervisor import die_with_parent
from tests.cluster.launch import alive, descendants
from tests.utils import real_model_path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"
VENV_TANDEM = ".venv/bin/tandem"
SERVICES = ("prefill", "decode", "router")
START_DEADLINE_S = 240.0
STOP_GRACE_S = 15.0
CTRL_C_EXIT_S = 30.0
CURL_TIMEOUT_S = 120.0
CURL_MAX_TOKENS = 8
GENERATE_TIMEOUT_S = 240.0
GENERATE_MAX_TOKENS = "4"

# A loopback host:port, bare or in a URL: the ports the README's commands use.
HOSTPORT = re.compile(r"^((?:https?://)?(?:localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\])):(\d+)(.*)$")


# -- reading README.md and the Makefile ---------------------------------------------------
def sh_lines(markdown: str) -> list[str]:
    """The command lines of the ```sh blocks: continuations joined, blanks dropped."""
    lines: list[str] = []
    for block in re.findall(r"^```sh\n(.*?)^```", markdown, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                lines.append(line.strip())
    return lines


def make_recipe(target: str) -> list[str]:
    """The recipe lines of one Makefile target (the tab-indented lines under it)."""
    lines = MAKEFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"^{re.escape(target)}\s*:(?!=)", line):
            recipe = []
            for body in lines[i + 1:]:
                if not body.startswith("\t"):
                    break
                recipe.append(body.strip())
            return recipe
    raise AssertionError(f"Makefile has no {target!r} target")


def make_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\??:?=\s*(\S+)", MAKEFILE.read_text(), flags=re.M)
    assert m, f"Makefile does not set {name}"
    return m.group(1)


@dataclass(frozen=True)
class Command:
    line: str
    """The README line, as written."""
    kind: str
    """make, curl, up, service, generate, or unknown."""
    argv: tuple[str, ...]
    """What runs (for make up: the `tandem up` its recipe is); ports not yet rewritten."""


def classify(line: str) -> Command:
    argv = tuple(shlex.split(line, comments=True))
    if argv[:1] == ("make",) and argv[1:] in (("up",), ("test",)):
        if argv[1] == "up":
            return Command(line, "make", (VENV_TANDEM, "up"))
        return Command(line, "make", argv)
    if argv[0] == "curl" and any(HOSTPORT.match(a) for a in argv[1:]):
        return Command(line, "curl", argv)
    if argv[0] == VENV_TANDEM and len(argv) > 1:
        sub = argv[1]
        if sub == "up":
            return Command(line, "up", argv)
        if sub in SERVICES:
            return Command(line, "service", argv)
        if sub == "generate":
            return Command(line, "generate", argv)
    return Command(line, "unknown", argv)


COMMANDS = [classify(line) for line in sh_lines(README.read_text())]


def clusters() -> list[tuple[str, list[Command]]]:
    """One cluster per distinct `tandem up` (make up's included), and one made of every
    prefill/decode/router line started together, as the README's pods would run."""
    ups: dict[tuple[str, ...], Command] = {}
    for c in COMMANDS:
        if c.argv[:2] == (VENV_TANDEM, "up"):
            ups.setdefault(c.argv, c)
    out = [(c.line.split("#")[0].strip(), [c]) for c in ups.values()]
    services = [c for c in COMMANDS if c.kind == "service"]
    if services:
        out.append(("+".join(c.argv[1] for c in services), services))
    return out


# -- rewriting a command ---------------------------------------------------------------
class Ports(dict):
    """README port -> a free loopback port, chosen on first use."""

    def __missing__(self, port: int) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self[port] = s.getsockname()[1]
        return self[port]


def tandem_exe() -> list[str]:
    exe = ROOT / VENV_TANDEM
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "tandem.cli"]


def model_args() -> list[str]:
    from tandem.fetch_model import default_model_path

    model = real_model_path()
    found = default_model_path()
    if found.is_file() and found.resolve() == model.resolve():
        return []
    return ["--model", str(model)]


def rewrite_ports(argv: tuple[str, ...], ports: Ports) -> list[str]:
    out: list[str] = []
    for tok in argv:
        if out and out[-1] == "--port" and tok.isdigit():
            tok = str(ports[int(tok)])
        elif tok.startswith("--port=") and tok[7:].isdigit():
            tok = f"--port={ports[int(tok[7:])]}"
        elif m := HOSTPORT.match(tok):
            tok = f"{m[1]}:{ports[int(m[2])]}{m[3]}"
        out.append(tok)
    return out


def parsed(argv: list[str]):
    """The real CLI's reading of a tandem command line (so defaults come from the code)."""
    from tandem.cli import build_parser

    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"README command does not parse: {shlex.join(argv)}")


def server_argv(cmd: Command, ports: Ports, ready_file: Path | None) -> tuple[list[str], int]:
    """(what to run, the port it serves on) for a `tandem up|prefill|decode|router` line."""
    args = parsed(list(cmd.argv))
    argv = rewrite_ports(cmd.argv, ports)
    has_port = any(a == "--port" or a.startswith("--port=") for a in argv)
    if not has_port and args.port:  # listening on a default port: map it like a named one
        argv += ["--port", str(ports[args.port])]
    if ready_file is not None:  # a worker started by hand, as a pod runs it
        argv += ["--ready-file", str(ready_file)]
        if not any(a.startswith("--num-threads") for a in argv):
            # pods have cores of their own; here two workers share this host's cores, and
            # torch's default (every core each) makes their parallel regions wait on
            # each other's threads: start-up took 63-100 s instead of 14-28
            argv += ["--num-threads", str(max(1, os.cpu_count() // 2))]
    port = ports[args.port] if args.port else 0
    return tandem_exe() + argv[1:] + model_args(), port


def capped_body(argv: list[str]) -> list[str]:
    """argv with max_tokens added to a JSON body (-d) that sets none."""
    out = list(argv)
    for i, tok in enumerate(out[:-1]):
        if tok in ("-d", "--data", "--data-raw"):
            with contextlib.suppress(ValueError):
                body = json.loads(out[i + 1])
                if isinstance(body, dict) and not ({"max_tokens", "max_completion_tokens"}
                                                   & body.keys()):
                    out[i + 1] = json.dumps({**body, "max_tokens": CURL_MAX_TOKENS})
    return out


def generate_argv(cmd: Command) -> list[str]:
    argv = list(cmd.argv)
    for i, tok in enumerate(argv):
        if tok == "--max-tokens":
            argv[i + 1] = GENERATE_MAX_TOKENS
            break
        if tok.startswith("--max-tokens="):
            argv[i] = f"--max-tokens={GENERATE_MAX_TOKENS}"
            break
    else:
        argv += ["--max-tokens", GENERATE_MAX_TOKENS]
    return tandem_exe() + argv[1:] + model_args()


# -- running servers -----------------------------------------------------------------------
@dataclass
class Server:
    cmd: Command
    popen: subprocess.Popen
    log: Path
    port: int
    ready_file: Path | None

    def tail(self, n: int = 4000) -> str:
        return f"--- {self.cmd.line}\n{self.log.read_text(errors='replace')[-n:]}"

    def is_ready(self) -> bool:
        if self.ready_file is not None:
            return self.ready_file.exists()
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


def tails(servers: list[Server]) -> str:
    return "\n".join(s.tail() for s in servers)


def kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop(servers: list[Server]) -> None:
    """SIGTERM every group, SIGKILL what is left after STOP_GRACE_S, then any stray
    descendant (a service tandem up could not stop)."""
    below = [d for s in servers if s.popen.poll() is None for d in descendants(s.popen.pid)]
    for s in servers:
        if s.popen.poll() is None:
            kill_group(s.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for s in servers:
        try:
            s.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(s.popen.pid, signal.SIGKILL)
            s.popen.wait(timeout=STOP_GRACE_S)
    for pid in below:
        if alive(pid):
            kill_group(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def started(cmds: list[Command], ports: Ports, tmp: Path):
    """Start every command at once (as pods would), wait until each serves, yield them."""
    servers: list[Server] = []
    try:
        for i, cmd in enumerate(cmds):
            ready = tmp / f"{i}.ready" if cmd.argv[1] in ("prefill", "decode") else None
            argv, port = server_argv(cmd, ports, ready)
            log = tmp / f"{i}.log"
            with open(log, "wb") as f:
                popen = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent())
            servers.append(Server(cmd, popen, log, port, ready))
        deadline = time.monotonic() + START_DEADLINE_S
        for s in servers:
            while not s.is_ready():
                assert s.popen.poll() is None, \
                    f"exited with code {s.popen.returncode} at start-up\n{s.tail()}"
                assert time.monotonic() < deadline, \
                    f"not ready after {START_DEADLINE_S:.0f} s\n{tails(servers)}"
                time.sleep(0.2)
        yield servers
    finally:
        stop(servers)


# -- checking answers ----------------------------------------------------------------------
def completion_text(stdout: str, streaming: bool) -> str:
    """The generated text of an OpenAI completion or chat answer; fails on anything else."""
    def text(choice: dict) -> str:
        if "text" in choice:
            return choice["text"]
        return (choice.get("message") or choice.get("delta") or {}).get("content") or ""

    if not streaming:
        body = json.loads(stdout)
        assert body.get("choices"), f"not a completion: {stdout[:500]}"
        return text(body["choices"][0])
    events = [line for line in stdout.splitlines() if line.strip()]
    assert events and events[-1] == "data: [DONE]", f"stream not ended by [DONE]:\n{stdout[-500:]}"
    chunks = []
    for event in events[:-1]:
        assert event.startswith("data: "), f"not an SSE data line: {event!r}"
        chunks.append(json.loads(event.removeprefix("data: ")))
    assert chunks and all("choices" in c for c in chunks), f"not completion chunks:\n{stdout[:500]}"
    return "".join(text(ch) for c in chunks for ch in c["choices"])


def run_curls(ports: Ports, servers: list[Server]) -> None:
    for c in (c for c in COMMANDS if c.kind == "curl"):
        argv = capped_body(rewrite_ports(c.argv, ports))
        where = f"{c.line}\n(ran {shlex.join(argv)})"
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=CURL_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            got = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
            got = got or ""
            pytest.fail(f"no full answer in {CURL_TIMEOUT_S:.0f} s ({got.count('data:')} SSE "
                        f"events so far): {where}\n{got[-1000:]}\n{tails(servers)}")
        assert r.returncode == 0, \
            f"curl exit {r.returncode}: {r.stderr}\n{where}\n{tails(servers)}"
        assert completion_text(r.stdout, "-N" in argv).strip(), \
            f"empty completion for {where}:\n{r.stdout[:1000]}"


def ctrl_c(server: Server) -> None:
    """README: `tandem up` ... 'Ctrl-C stops all of it' (the terminal sends the
    foreground process group SIGINT; the services, in their own sessions, do not get it)."""
    below = descendants(server.popen.pid)
    assert below, f"tandem up started no services\n{server.tail()}"
    kill_group(server.popen.pid, signal.SIGINT)
    try:
        code = server.popen.wait(timeout=CTRL_C_EXIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tandem up still running {CTRL_C_EXIT_S:.0f} s after Ctrl-C\n{server.tail()}")
    assert code == 0, f"tandem up exited {code} on Ctrl-C\n{server.tail()}"
    left = [pid for pid in below if alive(pid)]
    assert not left, f"Ctrl-C left services running: pids {left}"


# -- the tests -------------------------------------------------------------------------------
def test_every_command_is_known():
    assert COMMANDS, "README.md has no ```sh command lines (did the block syntax change?)"
    unknown = [c.line for c in COMMANDS if c.kind == "unknown"]
    assert not unknown, ("README.md gained command lines tests/test_readme.py does not know "
                         "how to run; teach it: " + "; ".join(unknown))


def test_make_targets_are_the_commands_we_run():
    assert make_var("VENV") + "/bin/tandem" == VENV_TANDEM
    assert make_recipe("up") == ["$(VENV)/bin/tandem up"], \
        "`make up` no longer runs just `tandem up`: update README.md and this test"
    assert any(re.match(r"\$\(VPY\) -m pytest\b", line) for line in make_recipe("test")), \
        "`make test` no longer runs pytest"


def test_make_lets_python_keep_its_bytecode():
    """Under PYTHONDONTWRITEBYTECODE (many CI images set it) every process the suite or
    `make up` starts would compile torch and the rest from source again: the Makefile
    unexports it, so what make runs caches its bytecode on first import."""
    probe = 'bytecode-probe: ; @echo "[$$PYTHONDONTWRITEBYTECODE]"'
    r = subprocess.run(["make", "-s", "--no-print-directory", "-f", str(MAKEFILE), "--eval", probe,
                        "bytecode-probe"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"make passes PYTHONDONTWRITEBYTECODE on: {r.stdout!r}"


@pytest.mark.slow
@pytest.mark.parametrize("cmds", [c for _, c in clusters()], ids=[n for n, _ in clusters()])
def test_cluster_serves_the_curl_lines(cmds: list[Command], tmp_path: Path):
    real_model_path()
    if not shutil.which("curl"):
        pytest.skip("curl is not installed")
    ports = Ports()
    with started(cmds, ports, tmp_path) as servers:
        run_curls(ports, servers)
        if cmds[0].argv[1] == "up":
            ctrl_c(servers[0])


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.kind == "generate"],
                         ids=lambda c: c.line)
def test_generate_prints_a_completion(cmd: Command):
    real_model_path()
    argv = generate_argv(cmd)
    r = subprocess.run(argv, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=GENERATE_TIMEOUT_S)
    assert r.returncode == 0, f"{cmd.line}\n(ran {shlex.join(argv)})\n{r.stderr[-4000:]}"
    assert r.stdout.strip(), f"no completion on stdout from {cmd.line}\n{r.stderr[-2000:]}"
