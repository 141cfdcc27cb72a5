"""The segment search's fronts: per span and side-input state, the Pareto front of (need,
ticks) of a segment over its structures (NOTE [ Searching segments ] in
``remat.plan.segment_search``), with the arithmetic of NOTE [ A segment's costs from per-block
numbers ] (``remat.plan.segments``) as a DP over a segment's items. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.plan.segments import SegmentModel, Tree

__all__ = ["Fronts"]

_NONE = -(2**62)


class Fronts:
    """Per (span, side-input state): the Pareto front of (need, ticks, tree) of a top-level
    segment over its structures (NOTE [ Searching segments ])."""

    def __init__(self, model: SegmentModel, exact: bool, max_len: int) -> None:
        self.m, self.exact, self.max_len = model, exact, max_len
        self._family: dict[tuple[int, int, int], dict[int, list[tuple[int, int, Tree]]]] = {}
        self._grads: dict[int, list[int]] = {}
        self._replays: dict[tuple[int, int, int], list[tuple[int, int, Tree]]] = {}
        self._tops: dict[tuple[int, int, int], list[tuple[int, int, Tree]]] = {}

    def top(self, s: int, e: int, before: int) -> list[tuple[int, int, Tree]]:
        """``before``: the side-input state before the segment."""
        key = (s, e, before)
        if key not in self._tops:
            m = self.m
            fwd, _ = m.forward_need(s, e, before)
            base = m.lead + m.kept(s, e)
            if self.exact:
                points = [(max(fwd, base + p), t, tree) for p, t, tree in self.replays(s, e, before)]
            else:
                points = [(max(fwd, base + p), t, tree) for p, t, tree in self.families(s, before)[e]]
            self._tops[key] = _front2(points)
        return self._tops[key]

    def families(self, s: int, before: int) -> dict[int, list[tuple[int, int, Tree]]]:
        """For every end e: the flat and the two-level segment [s..e] (NOTE [ Searching segments
        ]), their (replay peak, ticks) as ``SegmentModel.replay`` gives them, in one pass over e."""
        key = (s, -1, before)
        if key in self._replays:
            return self._family[key]
        m = self.m
        out: dict[int, list[tuple[int, int, Tree]]] = {}
        flat_level = two_level = -m.inp[s]
        flat_f = flat_b = two_f = two_b = _NONE
        ticks = temp = flat_x = 0
        flat_held = two_held = before  # the state at each item's backward, before its own
        singles: tuple[Tree, ...] = ()
        for e in range(s, min(m.reach[s] + 1, s + self.max_len)):
            flat_g = self._g(flat_held | m.saves[e])[e]
            ge = self._g(before | m.holds(s, e))[e]
            last_f = m.fork[e] + m.fs[e]
            flat = max(ge + max(flat_f, flat_level + last_f),
                       max(flat_b, flat_g + flat_level + m.kk[e] + m.bk[e] + flat_x + m.extra[e]) - m.stash(s, e))
            out[e] = [(flat, ticks + m.tr[e], Tree((s, e)))]
            if e > s:
                last_b = self._g(two_held | m.saves[e])[e] + two_level + m.kk[e] + m.bk[e]
                two = max(ge + max(two_f, two_level + temp + last_f), max(two_b, last_b + m.stash(s, e - 1) + m.extra[e]) - m.stash(s, e))
                out[e].append((two, 2 * ticks + m.tr[e], Tree((s, e), singles)))
            singles = (*singles, Tree((e, e)))
            flat_f = max(flat_f, flat_level + m.fork[e] + m.fk[e])
            flat_x += m.extra[e]
            flat_b = max(flat_b, flat_g + flat_level + m.kk[e] + m.bk[e] + flat_x)
            flat_level += m.kk[e]
            flat_held |= m.saves[e]
            two_f = max(two_f, two_level + temp + m.fr[e] + m.fork[e])
            alone = self.replays(e, e, two_held)[0][0]  # the inner segment of block e alone
            two_b = max(two_b, two_level + m.inp[e] + alone + m.stash(s, e))
            two_level += m.inp[e]
            two_held |= m.uses[e]
            temp += m.fork[e]
            ticks += m.tr[e]
        self._replays[key] = []
        self._family[key] = out
        return out

    def _g(self, held: int) -> list[int]:
        """[j]: the gradients and side inputs live at block j's backward with ``held`` held."""
        if held not in self._grads:
            m = self.m
            self._grads[held] = [m.grads_at[j] + m.delta(held, j) + m.gather for j in range(m.n)]
        return self._grads[held]

    def replays(self, s: int, e: int, before: int) -> list[tuple[int, int, Tree]]:
        """The front of (peak above the outer level, ticks, tree) of the backward of [s..e]; each
        partial replay carries its replay peak, its backward peak before the frame lets its own
        RNG states go, and those states (NOTE [ A segment's costs from per-block numbers ])."""
        key = (s, e, before)
        if key in self._replays:
            return self._replays[key]
        m = self.m
        ge = self._g(before | m.holds(s, e))[e]
        states: dict[int, list[_State]] = {s: [_State(-m.inp[s], 0, _NONE, _NONE, 0, 0, before, ())]}
        for p in range(s, e + 1):
            for st in _front_states(states.pop(p, [])):
                level, t, temp, held = st.level, st.ticks, st.temp, st.held
                g = self._g(held | m.saves[p])[p] + level + m.kk[p] + m.bk[p]
                f = ge + level + temp + m.fork[p] + (m.fk[p] if p < e else m.fs[p])
                states.setdefault(p + 1, []).append(_State(
                    level + m.kk[p], t + m.tr[p], max(st.rp, f), max(st.bp, g + st.cs + m.extra[p]), st.cs + m.extra[p], temp,
                    held | m.saves[p], st.kids))
                for b in range(p, min(e, m.reach[p]) + 1):
                    if (p, b) == (s, e):
                        continue
                    run = b < e
                    f0 = ge + level + temp + m.fz(p, b) if run else _NONE
                    extra = sum(m.tr[p : b + 1]) if run else 0
                    more = m.forks(p, b) if run else 0
                    cs = st.cs + m.stash(p, b)
                    for cp, ct, tree in self.replays(p, b, held):
                        states.setdefault(b + 1, []).append(_State(
                            level + m.inp[p], t + extra + ct, max(st.rp, f0), max(st.bp, level + m.inp[p] + cp + cs),
                            cs, temp + more, held | m.holds(p, b), (*st.kids, tree)))
        gone = m.stash(s, e)  # by each item's backward, all the segment stashed but ``cs`` there
        final = [(max(st.rp, st.bp - gone), st.ticks, Tree((s, e), st.kids)) for st in states.get(e + 1, [])]
        self._replays[key] = result = _front2(final)
        return result


@dataclass(frozen=True)
class _State:
    """A partial replay: the items of a segment so far (``Fronts.replays``)."""

    level: int
    ticks: int
    rp: int  # the replay's peak so far
    bp: int  # the items' backward peak so far, each candidate plus the RNG states of the inner
    # segments up to it: the frame's own and those of the inner segments after an item are gone
    # by the item's backward, so the peak is bp less all the segment's RNG states
    cs: int  # what the inner segments so far stash, and the code after the kept blocks before
    temp: int  # the RNG states of the inner frames the replay made so far (gone when it ends)
    held: int  # the side-input groups held at the next item's backward
    kids: tuple[Tree, ...]


def _front2(points: list[tuple[int, int, Tree]]) -> list[tuple[int, int, Tree]]:
    """The points no other beats on (value, ticks), fastest first."""
    out: list[tuple[int, int, Tree]] = []
    for p in sorted(points, key=lambda x: (x[1], x[0])):
        if not out or p[0] < out[-1][0]:
            out.append(p)
    return out


def _front_states(states: list[_State]) -> list[_State]:
    """The partial replays no other beats: no more level, ticks, replay peak or inner RNG
    states, no higher a backward peak, and no side-input group held that the other does not hold
    (each only raises what comes after)."""
    out: list[_State] = []
    for st in sorted(states, key=lambda x: (x.ticks, max(x.rp, x.bp), x.level)):
        if not any(o.level <= st.level and o.ticks <= st.ticks and o.rp <= st.rp and o.temp <= st.temp
                   and o.cs <= st.cs and o.bp <= st.bp and o.held & ~st.held == 0
                   for o in out):
            out.append(st)
    return out
