from elastictrain.cli.main import run

run()
