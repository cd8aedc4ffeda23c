"""Static checks: configurations that can deadlock or can never aggregate, found before
a run starts (`fedemu check`, and automatically at launch). Each finding names the rule
and the numbers."""
from __future__ import annotations

from fedemu.common.algorithms.base import Finding, get
from fedemu.common.algorithms.rounds import selected_per_round


def check(algorithm: dict, clients: int, network_can_drop: bool, round_dropout: float = 0.0) -> list[Finding]:
    """Findings for an [algorithm] section with K = ``clients``; ``round_dropout`` is
    network.dropout.per_round. The algorithm's own findings come first, then those of
    every round-based (or asynchronous) one."""
    name, K = algorithm["name"], clients
    cls = get(name)
    findings: list[Finding] = list(cls.findings(algorithm, K))
    who = cls.title or cls.label or name
    if cls.synchronous:
        if cls.selects_all:
            m, how = K, f"every client, as {who} selects"
        else:
            m, how = selected_per_round(algorithm["C"], K), f"m = max(C*K, 1), C = {algorithm['C']}, K = {K}"
        if algorithm["quorum"] > m:
            findings.append(Finding(
                "quorum-above-selection",
                f"algorithm.quorum = {algorithm['quorum']} exceeds the {m} clients selected per round "
                f"({how}): no round could aggregate", True))
        extra = algorithm.get("over_select", 0)
        if extra and cls.selects_all:
            findings.append(Finding(
                "over-select-not-applicable",
                f"algorithm.over_select = {extra}: {who} selects every client, so there is no one "
                f"extra to select",
                True))
        elif extra and m + extra > K:
            findings.append(Finding(
                "over-select-above-clients",
                f"algorithm.over_select = {extra} with m = {m} selects {m + extra} clients per round, "
                f"more than the K = {K} there are ({how})", True))
        if algorithm.get("on_quorum_missed") == "extend_once" and not algorithm["deadline_s"]:
            findings.append(Finding(
                "extend-without-deadline",
                "algorithm.on_quorum_missed = 'extend_once' extends the round deadline, but there is none "
                "(algorithm.deadline_s = 0): set a deadline or use 'skip'", True))
        if network_can_drop and not algorithm["deadline_s"]:
            findings.append(Finding(
                "sync-without-deadline",
                "a synchronous round with no deadline (algorithm.deadline_s = 0) waits for every selected client, "
                "but the network can drop clients or messages (drop-out or loss is configured): a round could "
                "wait forever. Set algorithm.deadline_s", True))
    elif round_dropout:
        findings.append(Finding(
            "dropout-per-round-async",
            f"network.dropout.per_round = {round_dropout} draws drop-outs at each round, but {name!r} is "
            f"asynchronous and has no rounds, so it would never take effect: use network.dropout.on_off or "
            f"windows", True))
    if not cls.synchronous and algorithm.get("over_select", 0):
        findings.append(Finding(
            "over-select-not-applicable",
            f"algorithm.over_select = {algorithm['over_select']} applies to round-based rules (fedavg, fedsgd); "
            f"{name!r} is asynchronous and merges every upload as it comes", True))
    return findings


def refusals(findings: list[Finding], accepted_risk: bool) -> list[Finding]:
    return [f for f in findings if f.blocking and not (f.waivable_by and accepted_risk)]
