// The `chorus` program (apps/cli.cpp is all of it but this line).
int chorus_main(int argc, char** argv, bool parse_only);

int main(int argc, char** argv) { return chorus_main(argc, argv, false); }
