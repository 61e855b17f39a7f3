from vllm_specplugin.verification.cli import main

main()
