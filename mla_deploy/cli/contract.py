"""The error contract of the ``mla-deploy`` command line (stated in the README's Errors section): every failure
prints exactly one line on stderr, ``mla-deploy: error: ...``:

* a user error (:class:`~mla_deploy.errors.MLADeployError`) or a file that cannot be written or read (``OSError``:
  no space, no permission, not a folder): exit 1;
* a malformed command line (click's usage errors: unknown option, bad choice, missing argument): exit 2;
* SIGINT, SIGTERM, SIGHUP: the command stops, its temporaries are removed, exit 128 + the signal number;
* anything else is a bug: the line names it and the file where the full traceback was written, exit 70.

:class:`MainGroup` is the command group that keeps it.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from .. import __version__
from ..errors import MLADeployError


#: exit status of an internal error (a bug): BSD's EX_SOFTWARE
EXIT_BUG = 70


def _fail(message: str, status: int) -> "NoReturn":
    """Print ``mla-deploy: error: <message>`` as one line on stderr and exit with ``status``."""
    click.echo(f"mla-deploy: error: {' '.join(str(message).split())}", err=True)
    sys.exit(status)


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived (SIGINT is Python's KeyboardInterrupt): unwinds like it, so every temporary
    folder and file is removed on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    import signal

    for other in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a second signal must not cut the cleanup short
        signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signum)


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


class MainGroup(click.Group):
    """The command group with the error contract of the module docstring."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        import signal

        if not standalone_mode:  # a caller that handles click's exceptions itself
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        handlers = {}
        for name in ("SIGTERM", "SIGHUP"):
            if hasattr(signal, name):
                try:
                    handlers[getattr(signal, name)] = signal.signal(getattr(signal, name), _on_signal)
                except ValueError:  # not the main thread: signals stay as they are
                    break
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            sys.exit(result if isinstance(result, int) else 0)  # click returns ctx.exit()'s code here
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.NoArgsIsHelpError as exc:  # `mla-deploy` alone: its help, not an error
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else "mla-deploy"
            _fail(f"{exc.format_message().rstrip('.')} (see `{command} --help`)", 2)
        except click.ClickException as exc:  # click.FileError and the like
            _fail(exc.format_message(), 1)
        except MLADeployError as exc:
            _fail(str(exc), 1)
        except OSError as exc:
            _fail(_os_error_line(exc), 1)
        except click.Abort:  # click's form of KeyboardInterrupt (and EOF at a prompt)
            _fail("interrupted (SIGINT); temporary files were removed", 128 + signal.SIGINT)
        except Interrupted as exc:
            _fail(f"interrupted ({signal.Signals(exc.signum).name}); temporary files were removed", 128 + exc.signum)
        except Exception as exc:  # noqa: BLE001 - a bug: one line and the traceback in a file
            _fail(_bug_line(exc), EXIT_BUG)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
