from edge_llm.cli import main

main()
