from verification.cli import main

main()
