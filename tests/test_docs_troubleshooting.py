"""The troubleshooting page lists every message of ln_lightning, each under a group with what to do.

docs/docgen/troubleshooting.py reads the messages from the source; docs/troubleshooting.yml groups them.
A new message no group takes, a group `match` that no longer finds its message, or a message that can't
be read as text fails here, naming it. The collector is tested on a package written for the test.
"""

from __future__ import annotations

import textwrap

from _helpers_docs import docgen

ts = docgen("troubleshooting")


def test_every_message_is_in_a_group():
    messages = ts.collect()
    assert len(messages) >= 150, f"only {len(messages)} messages collected: has the collector stopped reading the source?"
    groups, unsorted, stale = ts.sort(messages)
    assert not unsorted, "messages in no group of docs/troubleshooting.yml (add them to a group, with what to do):\n" + "\n".join(
        f"  {m.where} {m.kind}: {m.text}" for m in unsorted)
    assert not stale, "match strings in docs/troubleshooting.yml that find no message (did the message change?):\n" + "\n".join(
        f"  {title!r}: {s!r}" for title, s in stale)


def test_every_message_reads_as_text():
    """A message that is only fields was passed in a variable the collector could not follow."""
    unreadable = [m for m in ts.collect() if not m.readable and not ts.passed_on(m)]
    assert not unreadable, "\n".join(f"{m.where}: {m.text!r}" for m in unreadable)


def test_every_group_says_what_to_do():
    for g in ts.load_groups():
        assert g.title and len(g.do) > 40 and g.match, g.title


def test_the_page_shows_every_message():
    page = ts.render()
    for m in ts.collect():
        if not ts.passed_on(m):
            assert " ".join(m.text.split()) in page, m.where


def test_the_collector_reads_a_package(tmp_path, monkeypatch):
    pkg = tmp_path / "ln_lightning"
    pkg.mkdir()
    (pkg / "mod.py").write_text(textwrap.dedent('''
        from ._warnings import warn

        def check(x, report):
            if x < 0:
                raise PlacementError(f"a brand-new refusal of {x}; pass a positive x")
            msg = f"the block {x} was skipped"
            if x == 0:
                raise ValueError("strict conversion: " + msg)
            warn(_why(x))
            report.notes.append(f"note about {x.name}")

        def _why(x):
            return f"a warning built by a helper ({x})"
    '''))
    monkeypatch.setattr(ts, "PACKAGE", pkg)
    monkeypatch.setattr(ts, "ROOT", tmp_path)
    found = {(m.kind, m.text) for m in ts.collect()}
    assert found == {
        ("PlacementError", "a brand-new refusal of {x}; pass a positive x"),
        ("ValueError", "strict conversion: the block {x} was skipped"),
        ("warning", "a warning built by a helper ({x})"),
        ("report note", "note about {name}"),
    }
    groups, unsorted, _ = ts.sort(ts.collect())
    assert {m.text for m in unsorted} >= {"a brand-new refusal of {x}; pass a positive x"}  # no group takes it: the test above would fail
