"""The harness's seeds: no two samples of a task share vLLM's random stream (the chain-rule test
sums the prompts' statistics as independent draws)."""

from vllm_specplugin.verification.drivers import request_seed


def _streams(prompts: int, samples: int, per_request: int) -> list[int]:
    """Every sample's seed as vLLM derives it: request seed + the sample's index in its request."""
    seeds = []
    for prompt_index in range(prompts):
        first = 0
        while first < samples:
            n = min(per_request, samples - first)
            seeds += [request_seed(0, prompt_index, first, samples) + k for k in range(n)]
            first += n
    return seeds


def test_every_sample_has_its_own_stream():
    for prompts, samples, per_request in ((2, 3000, 3000), (2, 3000, 256), (32, 1, 1), (3, 7, 2)):
        seeds = _streams(prompts, samples, per_request)
        assert len(seeds) == prompts * samples and len(set(seeds)) == len(seeds), (prompts, samples, per_request)


def test_unseeded_stays_unseeded():
    assert request_seed(None, 3, 0, 10) is None
