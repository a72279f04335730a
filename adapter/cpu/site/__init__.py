"""The CPU harness sitecustomize's directory (put first on PYTHONPATH of CPU test servers); a
package only so the wheel ships it."""
