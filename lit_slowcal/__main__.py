from lit_slowcal.cli import main

main()
