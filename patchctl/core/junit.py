"""JUnit XML reports, so CI systems show check / smoke / apply results per case."""

from __future__ import annotations

import re
import socket
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from patchctl.core.fsutil import write_atomic

STATUSES = ("passed", "failed", "error", "skipped")
_BAD_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _clean(s) -> str:
    return _BAD_XML.sub("\ufffd", "" if s is None else str(s))


def write_junit(path, suite_name: str, cases: list[dict]) -> Path:
    """Write one <testsuite> with a <testcase> per case; written atomically.

    A case: {name, classname, time (seconds), status: passed|failed|error|skipped,
    message (one line), output (long text, e.g. the failing hunk)}.
    """
    path = Path(path)
    counts = {s: 0 for s in STATUSES}
    total = 0.0
    suites = ET.Element("testsuites", name=_clean(suite_name))
    suite = ET.SubElement(suites, "testsuite", name=_clean(suite_name),
                          timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"), hostname=_clean(socket.gethostname()))
    for c in cases:
        status = c.get("status", "passed")
        if status not in STATUSES:
            raise ValueError(f"junit case status {status!r} not one of {STATUSES}")
        counts[status] += 1
        t = float(c.get("time") or 0.0)
        total += t
        tc = ET.SubElement(suite, "testcase", name=_clean(c.get("name", "")),
                           classname=_clean(c.get("classname") or suite_name), time=f"{t:.3f}")
        message = _clean(c.get("message") or "")
        output = _clean(c.get("output") or "")
        if status == "failed":
            ET.SubElement(tc, "failure", message=message, type="failure").text = output or message
        elif status == "error":
            ET.SubElement(tc, "error", message=message, type="error").text = output or message
        elif status == "skipped":
            ET.SubElement(tc, "skipped", message=message)
        if output and status == "passed":
            ET.SubElement(tc, "system-out").text = output
    for el in (suites, suite):
        el.set("tests", str(len(cases)))
        el.set("failures", str(counts["failed"]))
        el.set("errors", str(counts["error"]))
        el.set("skipped", str(counts["skipped"]))
        el.set("time", f"{total:.3f}")
    ET.indent(suites)
    data = ET.tostring(suites, encoding="utf-8", xml_declaration=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data + b"\n")
    return path
