"""What every subcommand shares: the user-error exception, the exit status of each error category, and the
parameter -> flag names the library's messages are printed with."""

from __future__ import annotations

import re
import signal

from ..errors import ConversionError, DataError, EquiconvertError, PrivacyError, RunError, UsageError

# exit status by error category (equiconvert.errors), first match along the exception's classes; any other
# exception is a bug: Python prints its traceback and exits with 1
EXIT_CODES: dict[type[EquiconvertError], int] = {
    UsageError: 2,  # a flag, setting, name or recipe that cannot be used (argparse's own errors exit 2 too)
    DataError: 3,  # a data set, image or file read that is missing or malformed
    PrivacyError: 4,  # a privacy budget that cannot be met, a model DP-SGD cannot train privately
    ConversionError: 5,  # a model that cannot be converted
    RunError: 6,  # a run lost under way (a worker of the job gone)
}
EXIT_OTHER = 1  # an EquiconvertError of no category
EXIT_USAGE = EXIT_CODES[UsageError]


def exit_status_of_signal(signum: int) -> int:
    """The status of a command a signal stopped, as shells report it: 128 + the signal's number."""
    return 128 + int(signum)


EXIT_INTERRUPTED = exit_status_of_signal(signal.SIGINT)  # 130: a command stopped by Ctrl-C

# library parameter -> the flag that sets it; a message's `name=VALUE` is printed as `--flag VALUE`, and `name=True`
# or a bare `name=` as `--flag`
PARAMETER_FLAGS: dict[str, str] = {
    "out": "--out",
    "resume": "--resume",
    "overwrite": "--overwrite",
    "device": "--device",
    "delta": "--delta",
    "batch_size": "--batch-size",
    "data_dir": "--data-dir",
    "dataset": "--dataset",
    "allow_non_equivariant": "--allow-non-equivariant",
    "pad_to_valid": "--pad-to-valid",
    "crop_to_valid": "--crop-to-valid",
    "name_or_path": "--recipe",
    "assignments": "--set",
    "model_kwargs": "--model-kwargs",
    "group": "--group",
}
_PARAMETER = re.compile(r"(?<![\w.])(" + "|".join(PARAMETER_FLAGS) + r")=(True\b|(?=[\s,;:.)]|$))?")


class CLIError(UsageError):
    """A user error of the command line itself: reported as one `error: ...` line and exit status 2."""


def exit_code(error: EquiconvertError) -> int:
    """The exit status of `error`'s category (EXIT_CODES), EXIT_OTHER for none."""
    return next((EXIT_CODES[kind] for kind in type(error).__mro__ if kind in EXIT_CODES), EXIT_OTHER)


def flag_message(error: BaseException) -> str:
    """`error`'s message on one line, each library parameter named by its flag (out=/tmp/x -> --out /tmp/x)."""
    message = " ".join(str(error).split()) or type(error).__name__
    return _PARAMETER.sub(lambda m: PARAMETER_FLAGS[m[1]] + ("" if m[2] is not None else " "), message)
