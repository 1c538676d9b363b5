from hybridlb.cli import app

app()
