#include <cstdio>
int main() { std::puts("memtune"); return 0; }
