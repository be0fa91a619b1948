"""A slime user's custom reward module (``--custom-rm-path user_rm.rm`` / ``--group-rm``)."""

from slime.utils.types import Sample

CALLS = []


async def rm(args, sample):
    """Per sample: 1.0 when the response contains the label; checks it got a slime Sample."""
    assert isinstance(sample, Sample), type(sample)
    assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
    assert len(sample.tokens) > sample.response_length
    CALLS.append(sample)
    return float(str(sample.label) in sample.response) * getattr(args, "scale", 1.0)


async def group_rm(args, samples):
    """Per group (``--group-rm``): the rank of each response length inside the group."""
    assert all(isinstance(s, Sample) for s in samples)
    order = sorted(range(len(samples)), key=lambda i: (samples[i].response_length, i))
    ranks = [0.0] * len(samples)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


async def miles_group_rm(args, samples):
    """A miles user's ``--group-rm`` reward: 1.0 for the shortest response of the group."""
    from miles.utils.types import Sample as MilesSample

    assert all(isinstance(s, MilesSample) for s in samples)
    shortest = min(range(len(samples)), key=lambda i: (samples[i].response_length, i))
    return [1.0 if i == shortest else 0.0 for i in range(len(samples))]
