"""The engine's iteration phase: its named moves, alone and through an engine."""

import torch

import hybridps
from hybridps.iteration_phase import IterationPhase as P


def test_named_moves_cover_every_phase():
    for phase in P:  # every move is defined from every phase
        for move in (phase.forward_opens, phase.backward_ends, phase.grads_dropped, phase.step_ends):
            assert isinstance(move(), P)
    # accumulation: forward, backward, forward, backward, step
    phase = P.IDLE.forward_opens().backward_ends().forward_opens().backward_ends()
    assert phase is P.GRADS and phase.iteration_open and phase.grads_since_step
    assert phase.step_ends() is P.IDLE
    # zero_grad keeps an open iteration open; grads outside one leave nothing
    assert P.GRADS.grads_dropped() is P.FORWARD and P.UNTRACED_GRADS.grads_dropped() is P.IDLE
    assert P.IDLE.backward_ends() is P.UNTRACED_GRADS and P.UNTRACED_GRADS.forward_opens() is P.GRADS


def test_an_engine_walks_the_phases_of_an_iteration():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters()), hybridps.Config(precision="fp32"))
    seen = [engine.phase]
    loss = engine(torch.randn(4, 8)).square().mean()
    seen.append(engine.phase)
    engine.backward(loss)
    seen.append(engine.phase)
    engine.step()
    seen.append(engine.phase)
    engine.zero_grad()
    assert seen == [P.IDLE, P.FORWARD, P.GRADS, P.IDLE] and engine.phase is P.IDLE
    engine.close()
