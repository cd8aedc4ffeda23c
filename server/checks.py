"""Static checks: configurations that can deadlock or can never aggregate, found before
a run starts (`fedemu check`, and automatically at launch). Each finding names the rule
and the numbers."""
from __future__ import annotations

from dataclasses import dataclass

from .strategies import selected_per_round


ROUND_BASED = ("fedavg", "fedsgd", "fsvrg", "centralised")
SELECTS_ALL = {"fsvrg": "FSVRG", "centralised": "the centralised baseline"}  # rules that take every client


@dataclass(frozen=True)
class Finding:
    rule: str
    message: str
    blocking: bool  # refuse the run (unless the user accepted this risk, where allowed)
    waivable_by: str | None = None  # the config key that accepts the risk


def check(algorithm: dict, clients: int, network_can_drop: bool, round_dropout: float = 0.0) -> list[Finding]:
    """Findings for an [algorithm] section with K = ``clients``; ``round_dropout`` is
    network.dropout.per_round."""
    findings: list[Finding] = []
    name, K = algorithm["name"], clients
    if name == "coop":
        b_l, b_u = algorithm["b_l"], algorithm["b_u"]
        if b_l >= b_u:
            findings.append(Finding("coop-filter", f"CO-OP needs b_l < b_u; got b_l = {b_l}, b_u = {b_u}", True))
        if b_l >= K:
            findings.append(Finding(
                "coop-certain-deadlock",
                f"CO-OP with b_l = {b_l} >= K = {K} deadlocks for certain: at least b_l distinct clients must "
                f"upload before any client may upload again, and there are only {K} (Nilsson et al. 2018, 3.3.1)",
                True))
        elif b_u < 2 * b_l and K >= b_u - b_l + 1:
            findings.append(Finding(
                "coop-possible-deadlock",
                f"CO-OP with b_u = {b_u} < 2*b_l = {2 * b_l} and K = {K} >= b_u - b_l + 1 = {b_u - b_l + 1} can "
                f"deadlock (Nilsson et al. 2018, Theorem A.1): after b_u - b_l + 1 uploads by distinct clients, "
                f"every client can be over-active. Use b_u >= 2*b_l, or set algorithm.accept_deadlock_risk = true",
                True, waivable_by="algorithm.accept_deadlock_risk"))
    if name in ROUND_BASED:
        if name in SELECTS_ALL:
            m, how = K, f"every client, as {SELECTS_ALL[name]} selects"
        else:
            m, how = selected_per_round(algorithm["C"], K), f"m = max(C*K, 1), C = {algorithm['C']}, K = {K}"
        if algorithm["quorum"] > m:
            findings.append(Finding(
                "quorum-above-selection",
                f"algorithm.quorum = {algorithm['quorum']} exceeds the {m} clients selected per round "
                f"({how}): no round could aggregate", True))
        extra = algorithm.get("over_select", 0)
        if extra and name in SELECTS_ALL:
            findings.append(Finding(
                "over-select-not-applicable",
                f"algorithm.over_select = {extra}: {SELECTS_ALL[name]} selects every client, so there is no one "
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
    if name not in ROUND_BASED and algorithm.get("over_select", 0):
        findings.append(Finding(
            "over-select-not-applicable",
            f"algorithm.over_select = {algorithm['over_select']} applies to round-based rules (fedavg, fedsgd); "
            f"{name!r} is asynchronous and merges every upload as it comes", True))
    return findings


def refusals(findings: list[Finding], accepted_risk: bool) -> list[Finding]:
    return [f for f in findings if f.blocking and not (f.waivable_by and accepted_risk)]
