from runner.report.command import main

main()
