

from hybridlb.cli import main

main()
