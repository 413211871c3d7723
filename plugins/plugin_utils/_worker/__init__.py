# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Code that runs in ansible-core's task worker (a fresh fork per task).

The connection's and action plugins' side of the multiplexer. Standard library only, so a task imports nothing
heavy.
"""
