"""``python -m diloco_serverless.cli``: the same as the ``diloco`` command."""

from diloco_serverless.cli.app import main

main()
