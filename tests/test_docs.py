"""docs/semantics.md: its worked examples hold, its formulas give its numbers, and every
reference to one of its sections names a section that exists. The README stays a short entry
page whose links resolve and whose headline figures are the committed bench/results."""

from __future__ import annotations

import doctest
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEMANTICS = ROOT / "docs" / "semantics.md"

#: "docs/semantics.md section 4", "semantics sections 2 and 3", "semantics sections 1, 2, 4",
#: "docs/semantics.md sections 2-3", "docs/semantics.md, section 6"; a reference may wrap onto a
#: comment's next line.
_REFERENCE = re.compile(
    r"(?:docs/semantics\.md|semantics)[\s#*,]+sections?[\s#*]+"
    r"(\d+(?:[\s#*]*(?:,|and|-|–|to)[\s#*]*\d+)*)",
    re.IGNORECASE,
)
_HEADING = re.compile(r"^## (\d+)\. \S", re.MULTILINE)


def _text() -> str:
    return SEMANTICS.read_text(encoding="utf-8")


def section_numbers(text: str) -> list[int]:
    """Numbers of the top-level sections (``## N. Title``), in document order."""
    return [int(n) for n in _HEADING.findall(text)]


def referenced_sections(text: str) -> set[int]:
    """Every section number a semantics reference in ``text`` names (ranges expanded)."""
    numbers: set[int] = set()
    for match in _REFERENCE.finditer(text):
        group = match.group(1)
        for low, high in re.findall(r"(\d+)[\s#*]*(?:-|–|to)[\s#*]*(\d+)", group):
            numbers.update(range(int(low), int(high) + 1))
        numbers.update(int(n) for n in re.findall(r"\d+", group))
    return numbers


def dangling_references(sources: dict[str, str], sections: set[int]) -> list[str]:
    """``"file: section N"`` for every reference naming a section that does not exist."""
    return [
        f"{name}: section {n}"
        for name, text in sorted(sources.items())
        for n in sorted(referenced_sections(text) - sections)
    ]


def _sources() -> dict[str, str]:
    files = sorted((ROOT / "moeroute").rglob("*.py")) + [ROOT / "README.md"]
    files += [p for p in sorted((ROOT / "docs").glob("*.md")) if p != SEMANTICS]
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in files}


# --------------------------------------------------------------------- structure


def test_sections_are_numbered_one_to_eleven_in_order():
    assert section_numbers(_text()) == list(range(1, 12))


def test_every_section_reference_in_the_package_and_readme_exists():
    sections = set(section_numbers(_text()))
    assert dangling_references(_sources(), sections) == []


@pytest.mark.parametrize(
    "text, expected",
    [
        ("see docs/semantics.md section 4.", {4}),
        ("(docs/semantics.md sections 2 and 3)", {2, 3}),
        ("docs/semantics.md sections 1, 2, 4", {1, 2, 4}),
        ("semantics sections 2-5", {2, 3, 4, 5}),
        ("(docs/semantics.md, section 6)", {6}),
        ("# follows docs/semantics.md\n    # section 9 (placements)", {9}),
        ("the semantics of section 3", set()),  # prose, not a reference
        ("README section 2", set()),  # another document, not a reference
    ],
)
def test_reference_scanner_reads_every_spelling(text, expected):
    assert referenced_sections(text) == expected


def test_reference_scanner_reports_a_missing_section():
    sources = {"a.py": "# docs/semantics.md section 12", "b.py": "# semantics sections 1 and 3"}
    assert dangling_references(sources, {1, 2, 3}) == ["a.py: section 12"]


# --------------------------------------------------------------------- examples


def test_worked_examples_give_the_printed_results():
    """Every ``>>>`` line of the document, run with moeroute, prints what the document says."""
    text = _text()
    test = doctest.DocTestParser().get_doctest(text, {}, "docs/semantics.md", str(SEMANTICS), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    result = runner.run(test, out=report.append)
    assert result.failed == 0, "".join(report)
    assert result.attempted >= 60  # the examples were found (a broken fence would hide them)


# The document's numbers recomputed from its formulas, independently of moeroute. Each
# check also finds the printed result in the document, which the doctest above ties to
# moeroute's output.


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _shown(values) -> str:
    return "[[" + ", ".join(repr(round(v, 4)) for v in values) + "]]"


def test_softmax_weights_follow_the_formula():
    e = [math.exp(x) for x in (1.0, 2.0, 3.0, 0.0)]
    renormalized = [e[2] / (e[2] + e[1]), e[1] / (e[2] + e[1])]
    plain = [e[2] / sum(e), e[1] / sum(e)]
    assert f"([[2, 1]], {_shown(renormalized)})" in _text()
    assert _shown(plain) in _text()


def test_biased_sigmoid_weights_come_from_the_scores():
    # choice = sigmoid(x) + bias picks experts 3 and 1; the weights are their scores,
    # renormalized (sum + 1e-20) and times rsf = 2.5.
    scores = [_sigmoid(x) for x in (1.0, 2.0, 3.0, 0.0)]
    bias = [0.0, 0.0, -1.0, 0.5]
    choice = [s + b for s, b in zip(scores, bias)]
    picked = sorted(range(4), key=lambda i: (-choice[i], i))[:2]
    total = sum(scores[i] for i in picked) + 1e-20
    weights = [scores[i] / total * 2.5 for i in picked]
    assert f"({[picked]}, {_shown(weights)})" in _text()


def test_group_scores_follow_the_formula():
    x = [3.0, 0.0, 2.9, 2.8, 0.0, 0.0, 1.0, 1.0]
    groups = [[_sigmoid(v) for v in x[g * 2 : g * 2 + 2]] for g in range(4)]
    by_max = max(range(4), key=lambda g: (max(groups[g]), -g))
    by_top_two = max(range(4), key=lambda g: (sum(sorted(groups[g])[-2:]), -g))
    assert (by_max, by_top_two) == (0, 1)  # the document's contrast: groups 0 and 1


def test_sqrtsoftplus_and_none_weights_follow_the_formulas():
    softplus = [math.sqrt(math.log1p(math.exp(v))) for v in (2.0, 1.0)]
    assert f"([[3, 1]], {_shown(softplus)})" in _text()
    assert _shown([2.0 / (3.5 + 1e-20), 1.5 / (3.5 + 1e-20)]) in _text()


def test_swigluoai_follows_the_formula():
    def swigluoai(gate, up, alpha=1.702, limit=7.0):
        g = min(gate, limit)
        u = max(-limit, min(up, limit))
        return (u + 1) * g * _sigmoid(alpha * g)

    values = [swigluoai(10.0, -9.0), swigluoai(1.0, 2.0)]
    assert _shown(values)[1:-1] in _text()


def test_replica_hashes_and_block_formulas():
    text = _text()
    hashes = [(t * 2654435769) % 2**32 for t in range(4)]
    assert "are 0, 2654435769, 1013904242 and 3668340011" in text
    assert hashes == [0, 2654435769, 1013904242, 3668340011]
    # Contiguous blocks, P = 10 over E = 4.
    p, e = 10, 4
    blocks = [(r * (p // e) + min(r, p % e), p // e + (1 if r < p % e else 0)) for r in range(e)]
    assert str(blocks) in text
    # Per-rank slots, N = 8, S = 1, E = 2: b_r = a_r + r*S, routed p of rank r -> p + r*S.
    n, s, e = 8, 1, 2
    starts = [(r * (n // e), n // e) for r in range(e)]
    block_start = [a + r * s for r, (a, _) in enumerate(starts)]
    routed_id_map = [q + (q // (n // e)) * s for q in range(n)]
    expert_map_1 = [-1] * (n + e * s)
    for local, q in enumerate(range(block_start[1], block_start[1] + n // e + s)):
        expert_map_1[q] = local
    assert str(routed_id_map) in text and str(expert_map_1) in text
    assert f"[{block_start[1] + n // e}]" in text  # rank 1's shared slot id, 9


def test_align_capacity_and_combine_sums():
    text = _text()
    # align_block_size: C = numel + num_experts*(B - 1), rounded up to a multiple of B.
    for numel, experts, block in ((6, 4, 2), (4, 5, 2)):
        capacity = -(-(numel + experts * (block - 1)) // block) * block
        assert capacity == 10
    assert "([0, 4, 1, 2, 3, 5, 6, 6, 6, 6], [0, 1, 2, -1, -1], 6)" in text
    # combine: out[t] = sum_k w[t, k] * expert_out[inverse_index[t, k]] over entries >= 0.
    expert_out = [10.0, 20.0, 30.0, 40.0, 50.0]
    inverse = [[3, 0], [1, -1], [2, 4]]
    weights = [[0.5, 0.5], [1.0, 1.0], [0.25, 0.75]]
    out = [[sum(w * expert_out[i] for w, i in zip(wr, ir) if i >= 0)] for wr, ir in zip(weights, inverse)]
    assert str(out) in text


def test_shared_slot_weight_regimes():
    gate, rsf = 0.5, 2.5
    text = _text()
    assert f"shared_slot_weight({gate}, {rsf})\n{gate}\n" in text
    assert f'scaling_regime="output").shared_slot_weight({gate}, {rsf})\n{gate / rsf}\n' in text


# --------------------------------------------------------------------- README and the pages

README = ROOT / "README.md"
#: Pages linked before they exist: written with the change that adds what they describe.
PENDING_PAGES: set[str] = set()


def _local_links(path: Path) -> list[str]:
    """Relative link targets of a Markdown file (no scheme, no bare anchors), anchors kept."""
    targets = re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8"))
    return [t for t in targets if "://" not in t and not t.startswith("#")]


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces
    to hyphens (fenced code skipped)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    headings = re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_stays_a_short_entry_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300
    text = "\n".join(lines)
    assert "No GPU code path has run on a GPU yet" in text  # the status an integrator needs first
    for command in ("make demo", "make test"):
        assert f"    {command}" in text


def test_every_local_link_of_the_readme_and_the_docs_resolves():
    missing = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for link in _local_links(page):
            target, _, anchor = link.partition("#")
            resolved = (page.parent / target).resolve()
            if not resolved.exists():
                if str(resolved.relative_to(ROOT)) not in PENDING_PAGES:
                    missing.append(f"{page.relative_to(ROOT)} -> {link}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                missing.append(f"{page.relative_to(ROOT)} -> {link} (no such heading)")
    assert missing == []


def test_anchor_spelling_follows_github():
    page = ROOT / "docs" / "performance.md"
    assert "the-vllm-plugin-against-vllms-cpu-moe" in _anchors(page)
    assert "cuda-launch-host-cost-per-call-no-gpu" in _anchors(page)


def test_readme_headline_figures_are_the_committed_results():
    """Each figure of the README's Performance table, recomputed from bench/results."""
    import json

    def load(name):
        return json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text(encoding="utf-8"))

    routing = {r["preset"]: r for r in load("routing")["select_experts"]}
    decode = {(r["hidden"], r["dtype"], r["tokens"]): r for r in load("layer")["decode"]}
    vllm = {r["tokens"]: r for r in load("vllm")["layer"]}
    fp8 = {r["tokens"]: r for r in load("quant")["results"]["qwen3_30b_a3b"]}
    mxfp4 = {r["tokens"]: r for r in load("quant_mxfp4")["results"]}
    fp8_avx2 = {r["tokens"]: r for r in load("quant_avx2")["results"]["qwen3_30b_a3b"]}
    mxfp4_avx2 = {r["tokens"]: r for r in load("quant_mxfp4_avx2")["results"]}
    int4 = {r["tokens"]: r for r in load("quant_int4")["results"]["qwen3_30b_a3b"]}
    int4_avx2 = {r["tokens"]: r for r in load("quant_int4_avx2")["results"]["qwen3_30b_a3b"]}
    avx2_runs = ("quant_avx2", "quant_mxfp4_avx2", "quant_int4_avx2")
    assert {load(name)["machine"]["isa"] for name in avx2_runs} == {"avx2"}
    live = load("eplb")["live_rebalance"]
    expected = [
        f"| {routing['deepseek-v3']['speedup']:.1f}x |",
        f"| {decode[(1024, 'bfloat16', 1)]['speedup']:.2f}x |",
        f"| {vllm[1]['experts']['speedup']:.2f}x / {vllm[8]['experts']['speedup']:.2f}x |",
        f"| {load('vllm')['end_to_end']['speedup']:.2f}x |",
        f"| {fp8[1]['speedup']:.2f}x / {fp8_avx2[1]['speedup']:.2f}x |",
        f"| {mxfp4[1]['speedup']:.2f}x / {mxfp4_avx2[1]['speedup']:.2f}x |",
        f"| {int4[1]['bfloat16_over_int4']:.2f}x / {int4_avx2[1]['bfloat16_over_int4']:.2f}x |",
        f"| {live['balancedness_before']:.2f} -> {live['balancedness_after']:.3f} |",
    ]
    text = README.read_text(encoding="utf-8")
    assert [row for row in expected if row not in text] == []
