from specport.runtime.speculative.replay import ReplayProposer


def test_replay_drafts_the_known_continuation():
    proposer = ReplayProposer([1, 2], [7, 8, 9, 10])
    assert proposer.propose([[1, 2]], 3).row(0) == [7, 8, 9]
    assert proposer.propose([[1, 2, 7, 8]], 3).row(0) == [9, 10]  # clipped at its end
    assert proposer.propose([[1, 2, 7, 8, 9, 10]], 3).row(0) == []


def test_replay_drafts_nothing_off_its_track():
    proposer = ReplayProposer([1, 2], [7, 8, 9])
    assert proposer.propose([[1, 2, 5]], 2).row(0) == []
    assert proposer.propose([[1]], 2).row(0) == []
