"""What the optional parts of the install (pyproject's extras) bring, and the console scripts' front: a
command run where its extra is missing prints one line naming the extra and the pip command, and exits 2,
instead of an import traceback.

onnxruntime comes in two distributions, `onnxruntime` (CPU) and `onnxruntime-gpu` (CUDA, TensorRT and
CPU), which install the same `onnxruntime` package over each other and so must not share an environment.
The base install has neither: the `cpu` and `gpu` extras bring one each, `export` brings `cpu` and
`export-gpu` brings `gpu`, and every install names exactly one of them.

Imports nothing beyond the standard library, so that it runs where any extra, onnxruntime included, is
missing.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from importlib import metadata
from importlib.machinery import ExtensionFileLoader, ModuleSpec
from importlib.util import find_spec
from typing import IO, Any

DISTRIBUTION = "cosyvoice-onnx"
ONNXRUNTIME = "onnxruntime"
"""The module both onnxruntime distributions provide."""
CPU_ONNXRUNTIME, GPU_ONNXRUNTIME = "onnxruntime", "onnxruntime-gpu"
"""The two distributions of it."""
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "export": ("torch", "transformers", "safetensors", "onnx", "onnxslim", "onnx_ir", "librosa",
               "huggingface_hub", "filelock"),
    "serve": ("fastapi", "uvicorn", "websockets", "multipart", "python_multipart", "grpc", "google.protobuf",
              "av"),
    "ray": ("ray",),
}
"""The modules each extra a console script may need brings (besides onnxruntime), by import name."""


def installed(distribution: str) -> bool:
    """Whether `distribution` is installed in this environment."""
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` this environment cannot import (found without importing them)."""
    return [name for name in EXTRA_MODULES[extra] if not _findable(name)]


def require_extra(extra: str) -> None:
    """Raise the `ModuleNotFoundError` importing `extra`'s first missing module would raise (which
    `run_console_script` turns into one line naming the extra), without importing any: for a command that
    judges its input before it imports them."""
    missing = missing_modules(extra)
    if missing:
        raise ModuleNotFoundError(f"No module named {missing[0]!r}", name=missing[0])


def install_command(extra: str) -> str:
    """The pip command that adds `extra` to this environment without a second onnxruntime: where
    onnxruntime-gpu is installed, the export extra is `export-gpu`."""
    if extra == "export" and installed(GPU_ONNXRUNTIME):
        extra = "export-gpu"
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def gpu_install_command(tensorrt: bool = False) -> str:
    """The pip command that gives this environment onnxruntime-gpu, and with `tensorrt` TensorRT and
    polygraphy (the `trt` extra): the CPU build goes first, since the two overwrite each other's files."""
    extras = ["export-gpu" if _findable("torch") else "gpu", *(["trt"] if tensorrt else [])]
    install = f"pip install '{DISTRIBUTION}[{','.join(extras)}]'"
    if installed(CPU_ONNXRUNTIME):
        return f"pip uninstall -y {CPU_ONNXRUNTIME} {GPU_ONNXRUNTIME} && {install}"
    return install


SCRIPT_EXTRA = {"cosyvoice-export": "export", "cosyvoice-serve": "serve"}
"""The extra a console script needs whatever it is asked (the others need theirs for some commands only)."""
WITH_ONNXRUNTIME = {"export": ("export", "export-gpu")}
"""Extras that bring an onnxruntime build themselves: (with the CPU build, with the GPU build)."""


def missing_extra_line(script: str, error: ImportError, extras: tuple[str, ...]) -> str | None:
    """The one line that tells the user of `script` what to install, when `error` is a module of
    onnxruntime or of one of `extras` that is not installed; None for any other import error. Where the
    script's own extra (`SCRIPT_EXTRA`) is missing as well as onnxruntime, the line names both, with the one
    command that installs them."""
    name = error.name or ""
    ort_missing = _provides(ONNXRUNTIME, name)
    missing = next((e for e in extras if any(_provides(m, name) for m in EXTRA_MODULES[e])), None)
    if not ort_missing and missing is None:
        return None
    own = SCRIPT_EXTRA.get(script)
    if ort_missing and own is not None and missing_modules(own):
        missing = own
    elif missing is not None and missing == own and not _findable(ONNXRUNTIME):
        ort_missing = True
    if missing is None:
        return (f"error: {script} needs onnxruntime, which is not installed: pip install "
                f"'{DISTRIBUTION}[cpu]' (on a CUDA machine '{DISTRIBUTION}[gpu]')")
    if not ort_missing:
        return (f"error: {script} needs the {missing} extra ({name} is not installed): "
                f"{install_command(missing)}")
    cpu, gpu = WITH_ONNXRUNTIME.get(missing, (f"cpu,{missing}", f"gpu,{missing}"))
    return (f"error: {script} needs onnxruntime and the {missing} extra, which are not installed: pip "
            f"install '{DISTRIBUTION}[{cpu}]' (on a CUDA machine '{DISTRIBUTION}[{gpu}]')")


@contextmanager
def one_line_usage_errors() -> Iterator[None]:
    """Within it, click reports a usage error (an option missing, unknown or out of its range) as one line,
    `error: MESSAGE`, with exit status 2, as the commands report their own refusals, instead of the usage,
    a hint and the message. Click shows the error itself before it exits (standalone mode), so it is how
    the error shows itself that changes, and only for the block."""
    import click  # a base dependency, imported here so that this module imports the standard library only

    def one_line(self: click.UsageError, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {' '.join(self.format_message().split())}", file=file, err=True)

    show = click.UsageError.show
    click.UsageError.show = one_line  # type: ignore[method-assign]
    try:
        yield
    finally:
        click.UsageError.show = show  # type: ignore[method-assign]


INTERRUPTED = 130
"""The exit status of a command Ctrl-C (SIGINT) stopped: the shell's 128 + SIGINT, which no command gives
an outcome of its own (1 is a failed check or validation, 2 bad input)."""


@contextmanager
def interrupted_exits_130() -> Iterator[None]:
    """Within it, a KeyboardInterrupt that ends a click command, or the block before the command starts (its
    modules importing), prints click's "Aborted!" and exits with `INTERRUPTED`, where click's standalone
    mode would exit 1, the status of a failure, and Python would print a traceback. Click's
    `Command.invoke` (which a group's subcommands run through too) is what changes, and only for the
    block."""
    import click  # a base dependency, imported here so that this module imports the standard library only

    invoke = click.Command.invoke

    def interruptible(self: click.Command, ctx: click.Context) -> Any:
        try:
            return invoke(self, ctx)
        except KeyboardInterrupt:
            click.echo("\nAborted!", err=True)  # the newline closes the terminal's ^C echo, as click's does
            raise click.exceptions.Exit(INTERRUPTED) from None

    click.Command.invoke = interruptible  # type: ignore[method-assign]
    try:
        yield
    except KeyboardInterrupt:
        click.echo("\nAborted!", err=True)
        sys.exit(INTERRUPTED)
    finally:
        click.Command.invoke = invoke  # type: ignore[method-assign]


def open_standard_streams() -> None:
    """Put the null device where stdin, stdout or stderr is closed (`2>&-`, a daemon's closed descriptors):
    Python leaves such a stream None, and the first progress line or log record would fail on it; what
    would have gone there is dropped, as a shell's `>/dev/null` drops it."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False, errors="backslashreplace"))


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread (`termination_unwinds`). Not an `Exception`, so that no
    handler of errors takes it for one; `finally` blocks and `except BaseException` cleanups run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


UNWOUND_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals whose default action, ending the process on the spot, becomes an unwinding: SIGTERM (`kill`,
`docker stop`, systemd) and SIGHUP (the terminal or ssh session closed)."""


@contextmanager
def termination_unwinds() -> Iterator[None]:
    """Within it, `UNWOUND_SIGNALS` unwind the command as Ctrl-C does, so that its cleanups run (temporary
    files, staging folders, a child process), where the default action would end the process on the spot;
    then the process ends by the signal as it would have (128 + the signal to a shell), or, where the signal
    cannot end it (a container's PID 1), exits so. A SIGHUP that is ignored (nohup's request to run on) is
    left so. After a SIGHUP the terminal is gone: what the cleanups write to it goes to /dev/null, as a write
    there would fail (EIO) and stop them."""
    def terminate(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            _detach_terminal()
        raise Terminated(signum)

    previous = {signum: signal.getsignal(signum) for signum in UNWOUND_SIGNALS}
    taken = [signum for signum in UNWOUND_SIGNALS
             if signum != signal.SIGHUP or previous[signum] == signal.SIG_DFL]
    for signum in taken:
        signal.signal(signum, terminate)
    try:
        yield
    except Terminated as e:
        signal.signal(e.signum, signal.SIG_DFL)
        signal.raise_signal(e.signum)
        sys.exit(128 + e.signum)
    finally:
        for signum in taken:
            signal.signal(signum, previous[signum])


HELD_SIGNALS = (signal.SIGINT, *UNWOUND_SIGNALS)
"""The signals whose handlers raise in the main thread (Ctrl-C's KeyboardInterrupt, `Terminated`)."""


class _InitHold:
    """The `HELD_SIGNALS` that came while the main thread initialised an extension module
    (`extension_inits_hold_signals`)."""

    def __init__(self) -> None:
        self.holding = False
        """Within a loader call: one that it starts (a module its initialisation imports) is within it."""
        self.module: str | None = None
        """The module that `came` came during."""
        self.came: list[int] = []
        self._handlers: dict[signal.Signals, Any] = {}

    def take(self, module: str) -> None:
        if self.came and module != self.module:
            self.deliver()  # they came as a module was created that was never executed (`module_from_spec`)
        self.holding, self.module = True, module
        self._handlers = {n: h for n in HELD_SIGNALS if callable(h := signal.getsignal(n))}
        for signum in self._handlers:
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame: object) -> None:
        self.came.append(signum)

    def release(self) -> None:
        for signum, handler in self._handlers.items():
            if signal.getsignal(signum) == self._record:  # else the module set a handler of its own: kept
                signal.signal(signum, handler)
        self.holding, self._handlers = False, {}

    def deliver(self) -> None:
        """Raise again what came, to the handlers they were held from."""
        came, self.came = dict.fromkeys(self.came), []
        for number in came:
            signal.raise_signal(number)


@contextmanager
def extension_inits_hold_signals() -> Iterator[None]:
    """Within it, a `HELD_SIGNALS` signal that comes while the main thread creates or executes an extension
    module is held, and raised again once the module is whole (its execution has ended, or its creation
    failed). Its handler's exception would be raised in the Python code the module's C++ initialisation
    runs, which does not unwind from it: onnx's (nanobind) aborted the process or crashed it (SIGSEGV, also
    when raised between the module's creation and its execution), onnxruntime's (pybind11) failed with
    "ImportError: initialization failed", where the command should unwind and exit 130. Between the two
    calls the handlers are the command's own: a module created and never executed holds nothing."""
    create, execute = ExtensionFileLoader.create_module, ExtensionFileLoader.exec_module
    hold = _InitHold()

    def held(init: Any, whole_at_return: bool) -> Any:
        def call(self: ExtensionFileLoader, arg: Any) -> Any:
            if hold.holding or threading.current_thread() is not threading.main_thread():
                return init(self, arg)
            hold.take(arg.name if isinstance(arg, ModuleSpec) else arg.__name__)
            whole = True
            try:
                value = init(self, arg)
                whole = whole_at_return
                return value
            finally:
                hold.release()
                if whole:
                    hold.deliver()
        return call

    ExtensionFileLoader.create_module = held(create, False)  # type: ignore[method-assign]
    ExtensionFileLoader.exec_module = held(execute, True)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ExtensionFileLoader.create_module = create  # type: ignore[method-assign]
        ExtensionFileLoader.exec_module = execute  # type: ignore[method-assign]


def _detach_terminal() -> None:
    """Point the standard streams on a character device at /dev/null: a terminal, which once hung up no
    longer answers as one (`isatty` is False), and /dev/null itself."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the terminal gone, or the stream closed
            pass
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        try:
            on_device = stat.S_ISCHR(os.fstat(fd).st_mode)
        except OSError:  # closed
            continue
        if on_device:
            os.dup2(null, fd)
    os.close(null)


def run_console_script(script: str, module: str, extras: tuple[str, ...] = (), *,
                       unwind_on_signals: bool = True) -> None:
    """Run `module`'s `main` as the console script `script`, click's usage errors in one line
    (`one_line_usage_errors`), an interrupted run exiting 130 (`interrupted_exits_130`), even while a module
    initialises (`extension_inits_hold_signals`), and, unless `unwind_on_signals` is False (a command that
    takes SIGTERM as its own signal to stop), a terminated or hung-up one unwinding first
    (`termination_unwinds`); where onnxruntime or a module of one of `extras` is missing, when the CLI is
    imported or later in a command, print one line saying what to install and exit 2; a path it may not use
    (`PATH_ERRNOS`) or a file system that refuses a write (`WRITE_ERRNOS`), one line naming it, exit 2; the
    memory running out, one line, exit 1."""
    open_standard_streams()
    try:
        os.getcwd()
    except FileNotFoundError:  # relative paths, and modules that ask for it as they import, would fail
        print("error: the current folder no longer exists; change to another and run the command again",
              file=sys.stderr)
        sys.exit(2)
    try:
        with (termination_unwinds() if unwind_on_signals else nullcontext(), one_line_usage_errors(),
              interrupted_exits_130(), extension_inits_hold_signals()):
            importlib.import_module(module).main()
    except ModuleNotFoundError as e:
        line = missing_extra_line(script, e, extras)
        if line is None:
            raise
        print(line, file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.errno in WRITE_ERRNOS or (e.errno in PATH_ERRNOS and e.filename is not None):
            # what the checks before the work could not see coming: still one line
            where = f"{e.filename}: " if e.filename is not None else ""
            print(f"error: {where}{e.strerror}", file=sys.stderr)
            sys.exit(2)
        raise
    except MemoryError as e:  # numpy's says what it could not allocate
        print(f"error: out of memory{f' ({e})' if str(e) else ''}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:
        line = _onnxruntime_out_of_memory(e)
        if line is None:
            raise
        print(f"error: out of memory ({line})", file=sys.stderr)
        sys.exit(1)


PATH_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENAMETOOLONG, errno.ELOOP})
"""Errors of a path given (one it may not use, a name too long, a loop of symbolic links): on Python 3.11
even `Path.exists` raises them."""
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})
"""A file system refusing a write: full, over a quota or the file-size limit (`ulimit -f`), read-only, or
failing."""
ORT_ALLOCATION_FAILURES = ("bad_alloc", "Failed to allocate memory")
"""What onnxruntime's errors say where the memory ran out (loading a graph, or its arena)."""


def _onnxruntime_out_of_memory(error: Exception) -> str | None:
    """The gist of an onnxruntime error that says the memory ran out (its "[ONNXRuntimeError] : 1 : FAIL :"
    prefix left out), else None."""
    message = str(error).strip()
    if not type(error).__module__.startswith(ONNXRUNTIME) or not any(
            failure in message for failure in ORT_ALLOCATION_FAILURES):
        return None
    return message.splitlines()[0].rsplit(" : ", 1)[-1].strip()


def _provides(module: str, name: str) -> bool:
    """Whether importing `name` failing means `module` is missing: the same module, a package of it
    (`google` for `google.protobuf`) or a module inside it."""
    return name == module or module.startswith(f"{name}.") or name.startswith(f"{module}.")


def _findable(name: str) -> bool:
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False
