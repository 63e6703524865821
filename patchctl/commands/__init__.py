"""Porcelain: one module (or package) per command family. A command imports `patchctl.core` and the host
package, never another command."""
