"""The error contract of the ``mla-deploy`` command line (stated in docs/errors.md): every failure
prints exactly one line on stderr, ``mla-deploy: error: ...``:

* a user error (:class:`~mla_deploy.errors.MLADeployError`) or a file that cannot be written or read (``OSError``:
  no space, no permission, not a folder): exit 1;
* a malformed command line (click's usage errors: unknown option, bad choice, missing argument; an argument that
  is not UTF-8): exit 2;
* SIGINT, SIGTERM, SIGHUP: the command stops, its temporaries are removed, its child processes get the signal too
  (and are killed if they still run 3 s later), exit 128 + the signal number; a second signal is ignored; one that
  lands where Python drops exceptions (a weakref callback, a ``__del__``) is delivered again until it propagates;
* anything else is a bug: the line names it and the file where the full traceback was written, exit 70.

Standard output whose reader has gone (``mla-deploy presets | head -1``) ends the command without a line, exit 1
(click's own handling of ``EPIPE``, kept when the pipe breaks at the last flush too); standard output closed before
the start (``>&-``) is output discarded.

:class:`MainGroup` is the command group that keeps it.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

import click

from .. import __version__
from ..errors import MLADeployError


#: exit status of an internal error (a bug): BSD's EX_SOFTWARE
EXIT_BUG = 70


def _fail(message: str, status: int) -> "NoReturn":
    """Print ``mla-deploy: error: <message>`` as one line on stderr and exit with ``status``. Bytes that are not
    UTF-8 (a path or an argument decoded with ``surrogateescape``) are shown escaped, ``\\udcff``."""
    line = " ".join(str(message).split()).encode("utf-8", "backslashreplace").decode("utf-8")
    click.echo(f"mla-deploy: error: {line}", err=True)
    sys.exit(status)


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived: unwinds like KeyboardInterrupt, so every temporary folder and file is
    removed on the way out. (SIGINT is raised as KeyboardInterrupt inside the command, so that a command may
    catch it; :class:`MainGroup` turns it into this at the command's boundary.)"""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


#: the signals that stop a command (those this platform has)
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def _on_signal(signum, frame):
    """The first stop signal: later ones are ignored (they must not cut the cleanup short), the command's child
    processes get the same signal, and the command unwinds."""
    for name in STOP_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal_children(signum)
    _Redelivery.arm(signum)
    _raise_interrupt(signum)


def _raise_interrupt(signum: int) -> "NoReturn":
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(signum)


class _Redelivery:
    """Python drops an exception raised where it cannot propagate (a weakref callback such as the import system's
    module-lock one, a ``__del__``, a finalizer: "Exception ignored in ..."); a stop signal landing there would be
    lost and the command would run on. While a stop signal is being handled, ``sys.unraisablehook`` watches for
    our own interrupt being dropped and has the signal delivered to the main thread again a moment later, once the
    callback has returned, until it propagates and :class:`MainGroup` takes it."""

    signum: int | None = None
    previous_hook = None

    @classmethod
    def arm(cls, signum: int) -> None:
        if cls.signum is None:
            cls.signum = signum
            cls.previous_hook = sys.unraisablehook
            sys.unraisablehook = cls._on_unraisable

    @classmethod
    def disarm(cls) -> None:
        if cls.signum is not None:
            sys.unraisablehook = cls.previous_hook
            cls.signum = cls.previous_hook = None

    @classmethod
    def _on_unraisable(cls, unraisable) -> None:
        signum = cls.signum
        if signum is None or not isinstance(unraisable.exc_value, (Interrupted, KeyboardInterrupt)):
            (cls.previous_hook or sys.__unraisablehook__)(unraisable)
            return
        import threading

        def again(_signum, _frame):
            signal.signal(signum, signal.SIG_IGN)
            _raise_interrupt(signum)

        try:
            signal.signal(signum, again)  # the hook runs in the thread that ran the callback: the main one here
        except ValueError:
            return
        main = threading.main_thread().ident

        def deliver():
            if cls.signum == signum:  # not yet taken by MainGroup
                signal.pthread_kill(main, signum)

        timer = threading.Timer(0.02, deliver)
        timer.daemon = True
        timer.start()


def child_processes(pid: int | str = "self") -> list[int]:
    """Every running descendant of ``pid``, children first (Linux's ``/proc/PID/task/*/children``; elsewhere
    none). A child that has exited but was not waited for yet (a zombie) does not count."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
    except OSError:  # no /proc, or the process is gone
        return []
    found = [child for child in found if _running(child)]
    return found + [grandchild for child in found for grandchild in child_processes(child)]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # the state follows the (name)
    except (OSError, IndexError):
        return False


def signal_children(signum: int) -> None:
    """Send ``signum`` to every descendant of this process (a bench worker, a graph export)."""
    for pid in child_processes():
        try:
            os.kill(pid, signum)
        except OSError:  # already gone
            pass


def stop_children(grace_s: float = 3.0) -> None:
    """Kill the descendants still running ``grace_s`` after the stop signal was passed on to them: a command
    that was interrupted leaves no process behind."""
    import time

    deadline = time.monotonic() + grace_s
    while child_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    signal_children(signal.SIGKILL)


def _os_error_line(exc: OSError) -> str:
    """``cannot write PATH: No space left on device``-style text of an OSError."""
    what = exc.strerror or str(exc)
    if exc.filename is not None:
        return f"{exc.filename}: {what}"
    return what


def _bug_line(exc: BaseException) -> str:
    """Write the traceback of an unexpected exception to a file; the one line that names it and the file."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(exc))
    try:
        fd, path = tempfile.mkstemp(prefix="mla-deploy-traceback-", suffix=".txt")
        with open(fd, "w") as f:
            f.write(f"mla-deploy {__version__}\nargv: {sys.argv}\n\n{text}")
        where = f"full traceback in {path}"
    except OSError:
        where = "the traceback could not be written to a file"
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return (f"internal error (a bug in mla-deploy, please report it): {type(exc).__name__}: {first}; {where}")


def non_utf8_argument(args: list[str]) -> str | None:
    """What is wrong with the first argument of ``args`` that is not UTF-8 (Linux passes such bytes to Python as
    ``surrogateescape`` characters, which no tokenizer, path or ONNX Runtime call takes), or None."""
    for i, arg in enumerate(args):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raw = arg.encode("utf-8", "surrogateescape")
            if arg.startswith("-") and "=" in arg:
                where = f"the value of {arg.split('=', 1)[0]}"
            elif i and args[i - 1].startswith("-"):
                where = f"the value of {args[i - 1]}"
            else:
                where = f"argument {i + 1}"
            return f"{where} is not UTF-8 text: {raw!r}; give text and paths as UTF-8"
    return None


class MainGroup(click.Group):
    """The command group with the error contract of the module docstring."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:  # a caller that handles click's exceptions itself
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        args = sys.argv[1:] if args is None else list(args)
        wrong = non_utf8_argument(args)
        if wrong:
            command = next((a for a in args if a in self.commands), None)
            _fail(f"{wrong} (see `mla-deploy{' ' + command if command else ''} --help`)", 2)
        handlers = _install(_on_signal)
        stopped = False
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            if sys.stdout is not None:
                sys.stdout.flush()  # here, where a reader that has gone is seen, not at the interpreter's exit
            sys.exit(result if isinstance(result, int) else 0)  # click returns ctx.exit()'s code here
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.NoArgsIsHelpError as exc:  # `mla-deploy` alone: its help, not an error
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except (click.Abort, Interrupted) as exc:  # click.Abort: a KeyboardInterrupt while parsing, EOF at a prompt
            signum = getattr(exc, "signum", signal.SIGINT)
            stopped = True
            stop_children()
            _fail(f"interrupted ({_signal_name(signum)}); temporary files were removed", 128 + signum)
        except Exception as exc:  # noqa: BLE001 - every other failure: one line (a bug's names the traceback file)
            if isinstance(exc, BrokenPipeError) and _stdout_reader_gone():
                _exit_on_closed_stdout()
            _fail(*_error_line(exc))
        finally:
            _Redelivery.disarm()
            # once stopped, the stop signals stay ignored to the exit: a redelivery already on its way (or a second
            # Ctrl-C) reaching Python's default handler would turn exit 130 into a death by the signal
            _install(signal.SIG_IGN if stopped else handlers)

    def invoke(self, ctx):
        """Run the command; a KeyboardInterrupt leaving it is the interrupt of the contract (not click's Abort,
        which prints a blank line first)."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted(signal.SIGINT) from None


def _error_line(exc: Exception) -> tuple[str, int]:
    """The line and exit status of a failure (the module docstring's contract)."""
    if isinstance(exc, click.UsageError):
        command = exc.ctx.command_path if exc.ctx is not None else "mla-deploy"
        return f"{exc.format_message().rstrip('.')} (see `{command} --help`)", 2
    if isinstance(exc, click.ClickException):  # click.FileError and the like
        return exc.format_message(), 1
    if isinstance(exc, MLADeployError):
        return str(exc), 1
    if isinstance(exc, OSError):
        return _os_error_line(exc), 1
    return _bug_line(exc), EXIT_BUG


def _stdout_reader_gone() -> bool:
    """Standard output is a pipe or socket whose reading end has been closed."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, ValueError, OSError):
        return False


def _exit_on_closed_stdout() -> "NoReturn":
    """Exit as click does when a write meets a closed pipe: no line, 1. Standard output is pointed at /dev/null
    first, so that the interpreter's last flush of what is still buffered does not fail again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, ValueError, OSError):
        pass
    sys.exit(1)


def _signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _install(handlers) -> dict:
    """Install ``handlers`` (one callable for every stop signal, or ``{signum: handler}`` as returned here) and
    return the ones they replace. Outside the main thread signals stay as they are."""
    if not isinstance(handlers, dict):
        handlers = {getattr(signal, name): handlers for name in STOP_SIGNALS if hasattr(signal, name)}
    previous = {}
    for signum, handler in handlers.items():
        try:
            previous[signum] = signal.signal(signum, handler)
        except ValueError:  # not the main thread
            break
    return previous
