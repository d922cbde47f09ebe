from yrpd.cli import main

main()
