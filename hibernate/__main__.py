from hibernate.cli import main

main()
