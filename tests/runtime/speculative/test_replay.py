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


def test_replay_keeps_the_verify_width_off_its_track_when_asked():
    """Off its track a width-keeping replay drafts K guesses, so the verify run stays as wide
    as on the track; on the track it drafts as before."""
    proposer = ReplayProposer([1, 2], [7, 8, 9], keep_width=True)
    assert proposer.propose([[1, 2, 5]], 2).row(0) == [5, 5]
    assert proposer.propose([[1, 2, 7]], 4).row(0) == [8, 9]
