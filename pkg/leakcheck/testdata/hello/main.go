// Command hello is the smallest program a test builds with proctest.Build.
package main

func main() {}
