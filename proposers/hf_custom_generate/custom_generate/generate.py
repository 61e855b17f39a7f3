"""``model.generate(custom_generate=<this directory's parent>, trust_remote_code=True, ...)``.

transformers loads ``custom_generate/generate.py`` from a Hub repository or a local directory and
calls its ``generate(model, **generate_arguments)``. This one runs the plugin's speculative
decoding loop (vllm_specplugin.proposers.hf_generate.speculative_decoding) through transformers'
own argument preparation. Pass ``proposer=`` (a vllm_specplugin Proposer) or ``drafts=`` (draft
checkpoint paths, with ``spec_options=`` for build_proposer), and ``num_speculative_tokens=``.
"""


def generate(model, **kwargs):
    from vllm_specplugin.proposers.hf_generate import speculative_decoding

    kwargs.pop("custom_generate", None)
    return model.generate(custom_generate=speculative_decoding, **kwargs)
