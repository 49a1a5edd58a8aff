"""Flags as a learner parses them, for tests that call the shipped code directly.

The code reads flags.name with no fallback of its own (beast/flags.py holds the one table of
defaults), so a test gives it whole flags, with the few values it cares about on top, rather
than a Namespace of those few.
"""

from beast import flags as beast_flags


def make_flags(*argv, kind="vector", parser=None, **values):
    """The flags of `parser` (default: the common flags of both learners) parsed from argv,
    with the defaults of `kind`'s environments (beast.flags.ENV_DEFAULTS) filled in (precisions
    fp32), then
    `values` set. A name in `values` that is no flag of the parser is refused (a typo would
    otherwise test nothing)."""
    parser = parser or beast_flags.common_parser()
    flags = parser.parse_args([str(arg) for arg in argv])
    beast_flags.apply_env_defaults(flags, kind)
    # "auto" as on a CPU without bf16: a test's precision does not depend on the machine.
    beast_flags.resolve_precisions(flags, "cpu", cpu_bf16="none (emulated)")
    for key, value in values.items():
        if not hasattr(flags, key):
            raise AttributeError(f"make_flags: the parser has no flag --{key}")
        setattr(flags, key, value)
    return flags
