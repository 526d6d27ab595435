"""Every use of torch's private APIs and dynamo's internals, so that a new torch release is
checked in one folder (CI runs the tests of what uses these on every minor release).

- ``modes``: torch's per-thread function-mode stack and its ``DeviceContext``;
- ``dynamo``: dynamo's hooks: inlining, constants, trace rules, fake tensors.
"""
