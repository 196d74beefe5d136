"""The `specdec` subcommands: one module per command (or small group of commands), each with a
`register(sub)` that adds its parser(s) to argparse's subparsers and sets `run` to the function that
runs the parsed command. A command module parses arguments and prints; the work it starts lives in
the package that owns it. `specdec.cli.COMMANDS` lists the modules in the order `specdec --help`
shows them.
"""
