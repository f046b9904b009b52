"""``kiln advise`` as a whole: the inputs (flags, then questions at a terminal, then defaults), the evidence file,
and the recommendation written as text or JSON."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kiln._flags import flag
from kiln.advise.advise import advise
from kiln.advise.compare_file import load_compare
from kiln.advise.evidence import derive
from kiln.advise.prompt import Given, resolve
from kiln.advise.rules import render_rules, rules_as_json


@dataclass(frozen=True)
class AdviseOptions:
    """Everything ``kiln advise`` takes; each field is an option with its flag (kiln/_flags.py)."""

    given: Given = field(default_factory=Given)
    evidence: Path | None = field(default=None, metadata=flag(
        "--evidence", metavar="FILE", help="a `kiln bench compare` JSON result: measured p99, throughput and memory"))
    json: bool = field(default=False, metadata=flag("--json", form="switch",
                                                    help="print the recommendation as JSON"))
    rules: bool = field(default=False, metadata=flag("--rules", form="switch", help="print the rule table and exit"))
    no_input: bool = field(default=False, metadata=flag(
        "--no-input", form="switch", help="never prompt: inputs not given take their defaults (the answer lists them)"))


def run_advise(options: AdviseOptions, *, stdin: TextIO | None = None, stdout: TextIO | None = None,
               stderr: TextIO | None = None) -> int:
    """Write the recommendation (or the rule table) to ``stdout``; questions, when asked, go to ``stderr``."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if options.rules:
        stdout.write((json.dumps(rules_as_json(), indent=2) if options.json else render_rules()) + "\n")
        return 0
    compare = load_compare(options.evidence) if options.evidence is not None else None
    interactive = not options.no_input and stdin.isatty()
    # Questions go to stderr so that --json output on stdout stays parseable.
    inputs, assumed = resolve(options.given, interactive=interactive, ask_concurrency=compare is not None,
                              stdin=stdin, stdout=stderr)
    evidence = derive(compare, inputs) if compare is not None else None
    recommendation = advise(inputs, evidence, assumed)
    if options.json:
        stdout.write(json.dumps(recommendation.as_dict(), indent=2) + "\n")
    else:
        stdout.write(recommendation.render() + "\n")
    return 0
