// Package vmboot holds the end-to-end network boot test of the site agent:
// virtual machines whose own firmware (Debian's OVMF UEFI, and SeaBIOS)
// boot through two real site agent processes, in network namespaces the
// test creates. See vmboot_test.go and docs/site-agent.md ("The boot
// sequence, measured"). The package has no code of its own.
package vmboot
