"""Ctrl-C and SIGTERM end a command quickly and cleanly: cleanup runs, one line is printed, exit 130 / 143.

SIGTERM is turned into `Terminated` (a KeyboardInterrupt) in the main thread, so the same `finally` blocks run
as for Ctrl-C (`runtime_kernels.atomic.atomic_output_dir` removes its temporary directory). Once they have run,
the process leaves with `os._exit` after flushing stdio and logging: the normal interpreter teardown (freeing a
loaded model, joining torch's thread pools, unloading modules) took 1-3 s on the demo model and more on large
ones, and it does nothing an interrupted command needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

INTERRUPT_EXIT = 130  # 128 + SIGINT
TERMINATE_EXIT = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM."""

    exit_code = TERMINATE_EXIT


_received: list[int] = []  # signals delivered while `handle_interrupts` is active


def _raise_interrupt(signum, frame):
    _received.append(signum)
    raise KeyboardInterrupt


def _raise_terminated(signum, frame):
    _received.append(signum)
    raise Terminated(f"signal {signum}")


def interrupt_in_chain(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that `exc` is, or was raised from or during (typer turns one into `Exit(130)`)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def exit_now(code: int) -> None:
    """Flush what was printed and logged, then leave without the interpreter teardown."""
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _committed() -> list[str]:
    """Targets `runtime_kernels.atomic` replaced in this process (looked up, not imported: this module stays light)."""
    atomic = sys.modules.get("runtime_kernels.atomic")
    return list(getattr(atomic, "COMMITTED", []))


@contextlib.contextmanager
def handle_interrupts(message: str = "nothing was written or replaced (temporaries removed); run the command "
                                     "again", fast_exit: bool = True,
                      say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Around a CLI entry point: SIGTERM behaves like Ctrl-C; either ends with `message` and exit 130 / 143.

    The one line goes to `say` (the CLI's output object writes it to stderr); without one it is logged as a warning
    (this module does not print). With `fast_exit` (the process's own entry point) the process leaves at once after
    a real signal (`exit_now`); otherwise (a caller running the CLI in-process, such as a test) it raises
    `SystemExit` so the caller goes on.
    """
    main = threading.current_thread() is threading.main_thread()
    committed_before = len(_committed())
    previous = {}
    if main:
        _received.clear()
        previous = {signal.SIGINT: signal.signal(signal.SIGINT, _raise_interrupt),
                    signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_terminated)}
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as exc:
        interrupt = interrupt_in_chain(exc)
        if interrupt is None:
            raise
        signalled = bool(_received)
        if main and signalled:  # a second signal during the last prints must not bring back a traceback
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code = TERMINATE_EXIT if isinstance(interrupt, Terminated) else INTERRUPT_EXIT
        # What is on disk decides the words: an interrupt after (or during the end of) an output swap must not say
        # that nothing was replaced.
        said = getattr(interrupt, "outcome", None)
        # Every output this command replaced that is still there (a checkpoint removed at the end is not), once.
        written = [p for p in dict.fromkeys(_committed()[committed_before:]) if os.path.lexists(p)]
        if said is None and written:
            said = (f"{', '.join(written)} already {'holds' if len(written) == 1 else 'hold'} the complete new "
                    "content (written before the interrupt); temporaries removed")
        with contextlib.suppress(Exception):
            (say or logger.warning)(f"{'Terminated (SIGTERM)' if code == TERMINATE_EXIT else 'Interrupted'}; "
                                    f"{said or message}")
        if signalled and fast_exit:
            exit_now(code)
        raise SystemExit(code) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


__all__ = ["INTERRUPT_EXIT", "TERMINATE_EXIT", "Terminated", "exit_now", "handle_interrupts", "interrupt_in_chain"]
