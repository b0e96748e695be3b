"""
Command lines: every entry point (train.py, eval.py, report.py, rollout.py, bench.py, each prepare.py, data/teacher.py)
reports a user's mistake as one line, `error: <what is wrong and what to do>`, exit status 2, before any work starts.

    python train.py --group-size 0      # error: argument --group-size: must be an integer >= 1, got 0; see --help
"""
import argparse
import os
import sys
from pathlib import Path


class UserError(Exception):
    """A wrong flag or input found before any work; the entry point's __main__ prints it with die()."""


def die(message):
    print("error: " + " ".join(str(message).split()), file=sys.stderr)  # one line, whatever the message holds
    sys.exit(2)


def run(main):
    """An entry point's __main__: main(), a UserError as its one line. Under torchrun the process then ends at once:
    gloo's worker threads outlive destroy_process_group, and one that frees a tensor during interpreter teardown takes
    the GIL and aborts (SIGABRT, ~1 run in 20), failing a run whose outputs are all written."""
    try:
        main()
    except UserError as e:
        die(e)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default (unless its help already names it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"formatter_class": HelpFormatter, **kwargs})

    def error(self, message):  # argparse's own (bad choice, bad number, missing flag) would add the usage lines
        die(f"{message}; see --help")


def int_at_least(low):
    def parse(text):
        if not text.lstrip("-").isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return int(text)
    return parse


positive_int = int_at_least(1)  # a count
nonneg_int = int_at_least(0)    # a count where 0 means off or all


def boolean(text):
    """A switch given a value, as the recipes' tables write it: 1/0, true/false, yes/no, on/off."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"must be 1 or 0 (true or false), got {text}")


def existing_file(text):
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no file {text}; check the path")
    return text
